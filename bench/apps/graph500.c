/* A Graph-500-style benchmark (BFS, kernel 2, and SSSP, kernel 3) written for vrdma's
 * application benchmark (scripts/bench-apps.sh) and tests. It is NOT the reference code
 * (github.com/graph500/graph500): CI has no network, and no fetched code is committed here.
 * It follows the specification where that matters to the network:
 *   - Kronecker generator, initiator A=0.57 B=0.19 C=0.19 (D=0.05), 2^scale vertices,
 *     edgefactor (16) x 2^scale undirected edges, vertex labels scrambled by a bijection,
 *     uniform [0,1) weights; generated in parallel from a counter-based random stream, so
 *     the graph does not depend on the number of ranks.
 *   - 1-D distribution (vertex v lives on rank v % P, as the reference's), CSR of both
 *     directions of every edge, self-loops dropped, duplicates kept.
 *   - BFS: level-synchronous, each level's (child, parent) pairs to their owners with
 *     MPI_Alltoall (counts) + MPI_Alltoallv (data).
 *   - SSSP: delta-stepping over buckets of width delta (the reference's kernel 3 is a
 *     delta-stepping too), relaxation requests exchanged the same way; converges to exact
 *     distances.
 *   - Validation as the specification asks: the root is its own parent at level/distance 0;
 *     every tree edge is a graph edge; BFS levels of a tree edge differ by one and of any graph
 *     edge by at most one, with both ends reached or neither; SSSP distances are tight along
 *     tree edges and no edge can shorten any. (The checks gather the parent/distance arrays
 *     on every rank, which the reference avoids; fine for the scales this machine runs.)
 *   - Up to 64 roots (-n) among vertices with edges; TEPS = input edges in the root's
 *     component / kernel time; harmonic mean over roots.
 * Every root's result is validated (outside the timed kernels).
 * Usage: graph500 [-s scale] [-e edgefactor] [-n roots] [-S: BFS only]
 * Prints `key: value` lines; rank 0 ends with "graph500: validation passed". */
#include <mpi.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static int rank, nprocs, scale = 16, edgefactor = 16;
static int64_t nglobal, nlocal;
static int64_t *rowstart; /* CSR of local vertices: nlocal + 1 */
static int64_t *adj;      /* global neighbour ids */
static float *wgt;        /* their weights */

static void die(const char *what) {
  fprintf(stderr, "graph500 rank %d: %s\n", rank, what);
  MPI_Abort(MPI_COMM_WORLD, 1);
}

static void *xmalloc(size_t n) {
  void *p = malloc(n ? n : 1);
  if (!p) die("out of memory");
  return p;
}

static uint64_t mix(uint64_t x) { /* splitmix64's finaliser */
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

static double uniform(uint64_t a, uint64_t b) { /* [0,1) from the stream at (a, b) */
  return (double)(mix(mix(a) ^ b) >> 11) * (1.0 / 9007199254740992.0);
}

/* A bijection on [0, 2^scale): the scrambled vertex labels. */
static int64_t scramble(int64_t v) {
  uint64_t mask = (uint64_t)nglobal - 1, x = (uint64_t)v;
  for (int r = 0; r < 3; r++) {
    x = (x * 0x9e3779b97f4a7c15ULL + 0x632be59bd9b4e019ULL * (r + 1)) & mask; /* odd multiplier */
    x ^= x >> ((scale + 1) / 2);
  }
  return (int64_t)(x & mask);
}

/* Edge `e` of the Kronecker graph (the specification's recursive quadrant choice). */
static void kronecker_edge(int64_t e, int64_t *u, int64_t *v, float *w) {
  const double A = 0.57, B = 0.19, C = 0.19;
  const double ab = A + B, c_norm = C / (1 - ab), a_norm = A / ab;
  int64_t i = 0, j = 0;
  for (int bit = 0; bit < scale; bit++) {
    int ii = uniform((uint64_t)e, 2 * bit) > ab;
    int jj = uniform((uint64_t)e, 2 * bit + 1) > (c_norm * ii + a_norm * !ii);
    i |= (int64_t)ii << bit;
    j |= (int64_t)jj << bit;
  }
  *u = scramble(i);
  *v = scramble(j);
  *w = (float)uniform((uint64_t)e, 1000);
}

#define OWNER(v) ((int)((v) % nprocs))
#define LOCAL(v) ((v) / nprocs)
#define GLOBAL(l) ((l) * nprocs + rank)

/* Sends n items of `size` bytes to their owners; returns the received ones (count in *got).
 * dest[i] is item i's rank. Counts with MPI_Alltoall, data with MPI_Alltoallv. */
static void *exchange(const void *items, const int *dest, int64_t n, int size, int64_t *got) {
  int *scount = calloc(nprocs, sizeof(int)), *rcount = xmalloc(nprocs * sizeof(int));
  int *sdisp = xmalloc(nprocs * sizeof(int)), *rdisp = xmalloc(nprocs * sizeof(int));
  for (int64_t i = 0; i < n; i++) scount[dest[i]] += size;
  MPI_Alltoall(scount, 1, MPI_INT, rcount, 1, MPI_INT, MPI_COMM_WORLD);
  int64_t stot = 0, rtot = 0;
  for (int p = 0; p < nprocs; p++) {
    sdisp[p] = (int)stot;
    rdisp[p] = (int)rtot;
    stot += scount[p];
    rtot += rcount[p];
  }
  if (stot > 0x7fffffff || rtot > 0x7fffffff) die("exchange over 2 GiB");
  char *sbuf = xmalloc(stot), *rbuf = xmalloc(rtot);
  int *fill = xmalloc(nprocs * sizeof(int));
  memcpy(fill, sdisp, nprocs * sizeof(int));
  for (int64_t i = 0; i < n; i++) {
    memcpy(sbuf + fill[dest[i]], (const char *)items + i * size, size);
    fill[dest[i]] += size;
  }
  MPI_Alltoallv(sbuf, scount, sdisp, MPI_BYTE, rbuf, rcount, rdisp, MPI_BYTE, MPI_COMM_WORLD);
  free(sbuf);
  free(fill);
  free(scount);
  free(rcount);
  free(sdisp);
  free(rdisp);
  *got = rtot / size;
  return rbuf;
}

struct half_edge { /* `from` is owned by the receiver */
  int64_t from, to;
  float w;
};

static int by_from(const void *a, const void *b) {
  int64_t x = ((const struct half_edge *)a)->from, y = ((const struct half_edge *)b)->from;
  return (x > y) - (x < y);
}

/* Kernel 1: generate this rank's share of the edge list and build the CSR. */
static void construct(void) {
  int64_t m = (int64_t)edgefactor * nglobal;
  int64_t lo = m * rank / nprocs, hi = m * (rank + 1) / nprocs, n = 0;
  struct half_edge *out = xmalloc(2 * (hi - lo) * sizeof *out);
  int *dest = xmalloc(2 * (hi - lo) * sizeof(int));
  for (int64_t e = lo; e < hi; e++) {
    int64_t u, v;
    float w;
    kronecker_edge(e, &u, &v, &w);
    if (u == v) continue;
    out[n] = (struct half_edge){u, v, w};
    dest[n++] = OWNER(u);
    out[n] = (struct half_edge){v, u, w};
    dest[n++] = OWNER(v);
  }
  int64_t got;
  struct half_edge *in = exchange(out, dest, n, sizeof *out, &got);
  free(out);
  free(dest);
  qsort(in, got, sizeof *in, by_from);
  rowstart = calloc(nlocal + 1, sizeof(int64_t));
  adj = xmalloc(got * sizeof(int64_t));
  wgt = xmalloc(got * sizeof(float));
  for (int64_t i = 0; i < got; i++) {
    rowstart[LOCAL(in[i].from) + 1]++;
    adj[i] = in[i].to;
    wgt[i] = in[i].w;
  }
  for (int64_t l = 0; l < nlocal; l++) rowstart[l + 1] += rowstart[l];
  free(in);
}

struct visit {
  int64_t v, parent;
};

/* Kernel 2: BFS from `root`; parent[] of local vertices (-1: not reached). */
static void bfs(int64_t root, int64_t *parent) {
  for (int64_t l = 0; l < nlocal; l++) parent[l] = -1;
  int64_t *frontier = xmalloc(nlocal * sizeof(int64_t)), nf = 0;
  if (OWNER(root) == rank) {
    parent[LOCAL(root)] = root;
    frontier[nf++] = LOCAL(root);
  }
  int64_t cap = 1024;
  struct visit *out = xmalloc(cap * sizeof *out);
  int *dest = xmalloc(cap * sizeof(int));
  for (;;) {
    int64_t total;
    MPI_Allreduce(&nf, &total, 1, MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD);
    if (total == 0) break;
    int64_t n = 0;
    for (int64_t f = 0; f < nf; f++) {
      int64_t l = frontier[f];
      for (int64_t k = rowstart[l]; k < rowstart[l + 1]; k++) {
        int64_t v = adj[k];
        if (OWNER(v) == rank && parent[LOCAL(v)] >= 0) continue; /* cheap local filter */
        if (n == cap) {
          cap *= 2;
          out = realloc(out, cap * sizeof *out);
          dest = realloc(dest, cap * sizeof(int));
          if (!out || !dest) die("out of memory");
        }
        out[n] = (struct visit){v, GLOBAL(l)};
        dest[n++] = OWNER(v);
      }
    }
    int64_t got;
    struct visit *in = exchange(out, dest, n, sizeof *out, &got);
    nf = 0;
    for (int64_t i = 0; i < got; i++) {
      int64_t l = LOCAL(in[i].v);
      if (parent[l] < 0) {
        parent[l] = in[i].parent;
        frontier[nf++] = l;
      }
    }
    free(in);
  }
  free(out);
  free(dest);
  free(frontier);
}

struct relax {
  int64_t v, parent;
  double d;
};

/* Kernel 3: delta-stepping SSSP from `root`; dist[] (INFINITY: not reached), parent[]. */
static void sssp(int64_t root, double *dist, int64_t *parent, double delta) {
  for (int64_t l = 0; l < nlocal; l++) {
    dist[l] = INFINITY;
    parent[l] = -1;
  }
  char *active = calloc(nlocal, 1); /* changed since its edges were last relaxed */
  if (OWNER(root) == rank) {
    dist[LOCAL(root)] = 0;
    parent[LOCAL(root)] = root;
    active[LOCAL(root)] = 1;
  }
  int64_t cap = 1024;
  struct relax *out = xmalloc(cap * sizeof *out);
  int *dest = xmalloc(cap * sizeof(int));
  for (double lo = 0;;) {
    /* The smallest bucket holding an active vertex, over all ranks. */
    double mine = INFINITY, next;
    for (int64_t l = 0; l < nlocal; l++)
      if (active[l] && dist[l] < mine) mine = dist[l];
    MPI_Allreduce(&mine, &next, 1, MPI_DOUBLE, MPI_MIN, MPI_COMM_WORLD);
    if (isinf(next)) break;
    lo = floor(next / delta) * delta;
    double hi = lo + delta;
    /* Settle the bucket [lo, hi): relax until no vertex in it changes. */
    for (;;) {
      int64_t n = 0;
      for (int64_t l = 0; l < nlocal; l++) {
        if (!active[l] || dist[l] >= hi) continue;
        active[l] = 0;
        for (int64_t k = rowstart[l]; k < rowstart[l + 1]; k++) {
          double nd = dist[l] + wgt[k];
          int64_t v = adj[k];
          if (OWNER(v) == rank && dist[LOCAL(v)] <= nd) continue;
          if (n == cap) {
            cap *= 2;
            out = realloc(out, cap * sizeof *out);
            dest = realloc(dest, cap * sizeof(int));
            if (!out || !dest) die("out of memory");
          }
          out[n] = (struct relax){v, GLOBAL(l), nd};
          dest[n++] = OWNER(v);
        }
      }
      int64_t sent = n, total;
      MPI_Allreduce(&sent, &total, 1, MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD);
      if (total == 0) break;
      int64_t got;
      struct relax *in = exchange(out, dest, n, sizeof *out, &got);
      for (int64_t i = 0; i < got; i++) {
        int64_t l = LOCAL(in[i].v);
        if (in[i].d < dist[l]) {
          dist[l] = in[i].d;
          parent[l] = in[i].parent;
          active[l] = 1;
        }
      }
      free(in);
    }
  }
  free(out);
  free(dest);
  free(active);
}

/* The local array `part` (nlocal items of `size`) of every rank, as one global array. */
static void *gather_global(const void *part, int size) {
  char *all = xmalloc(nglobal * size), *tmp = xmalloc(nglobal * size);
  MPI_Allgather(part, (int)(nlocal * size), MPI_BYTE, tmp, (int)(nlocal * size), MPI_BYTE, MPI_COMM_WORLD);
  for (int p = 0; p < nprocs; p++)
    for (int64_t l = 0; l < nlocal; l++) memcpy(all + (l * nprocs + p) * size, tmp + (p * nlocal + l) * size, size);
  free(tmp);
  return all;
}

static int has_edge(int64_t l, int64_t to) {
  for (int64_t k = rowstart[l]; k < rowstart[l + 1]; k++)
    if (adj[k] == to) return 1;
  return 0;
}

/* Depth of every vertex in the parent tree (-1 not reached, -2 not a tree: a cycle or a
 * parent that was not reached). */
static int64_t *tree_levels(const int64_t *par, int64_t root) {
  int64_t *level = xmalloc(nglobal * sizeof(int64_t));
  for (int64_t v = 0; v < nglobal; v++) level[v] = par[v] < 0 ? -1 : -3; /* -3: to compute */
  if (par[root] != root) return level[root] = -2, level;
  level[root] = 0;
  int64_t *path = xmalloc(nglobal * sizeof(int64_t));
  for (int64_t v = 0; v < nglobal; v++) {
    int64_t n = 0, u = v;
    while (level[u] == -3 && n <= nglobal) {
      path[n++] = u;
      level[u] = -4; /* on the current path */
      u = par[u];
      if (u < 0 || u >= nglobal) break;
    }
    int64_t base = (u < 0 || u >= nglobal || level[u] < 0) ? -2 : level[u];
    while (n > 0) {
      n--;
      level[path[n]] = base < 0 ? -2 : ++base;
    }
  }
  free(path);
  return level;
}

/* Counts violations of the specification's BFS checks; *edges: input edges in the tree's
 * component (both directions of each in the CSR, so halved). */
static int64_t validate_bfs(int64_t root, const int64_t *parent, int64_t *edges) {
  int64_t *par = gather_global(parent, sizeof(int64_t)), bad = 0, twice = 0;
  int64_t *level = tree_levels(par, root);
  if (level[root] != 0) bad++;
  for (int64_t l = 0; l < nlocal; l++) {
    int64_t v = GLOBAL(l);
    if (level[v] == -2) bad++;
    if (par[v] >= 0 && v != root && (!has_edge(l, par[v]) || level[v] != level[par[v]] + 1)) bad++;
    for (int64_t k = rowstart[l]; k < rowstart[l + 1]; k++) {
      int64_t u = adj[k];
      if ((level[u] >= 0) != (level[v] >= 0)) bad++;
      else if (level[v] >= 0) {
        twice++;
        if (llabs(level[u] - level[v]) > 1) bad++;
      }
    }
  }
  int64_t all_bad, all_twice;
  MPI_Allreduce(&bad, &all_bad, 1, MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD);
  MPI_Allreduce(&twice, &all_twice, 1, MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD);
  free(par);
  free(level);
  *edges = all_twice / 2;
  return all_bad;
}

static float edge_weight(int64_t l, int64_t to) { /* the lightest of parallel edges */
  float best = INFINITY;
  for (int64_t k = rowstart[l]; k < rowstart[l + 1]; k++)
    if (adj[k] == to && wgt[k] < best) best = wgt[k];
  return best;
}

static int64_t validate_sssp(int64_t root, const double *dist, const int64_t *parent, int64_t *edges) {
  int64_t *par = gather_global(parent, sizeof(int64_t)), bad = 0, twice = 0;
  double *d = gather_global(dist, sizeof(double));
  int64_t *level = tree_levels(par, root);
  if (d[root] != 0 || level[root] != 0) bad++;
  for (int64_t l = 0; l < nlocal; l++) {
    int64_t v = GLOBAL(l);
    if (level[v] == -2 || (par[v] >= 0) != !isinf(d[v])) bad++;
    if (par[v] >= 0 && v != root) {
      double w = edge_weight(l, par[v]);
      if (isinf(w) || fabs(d[par[v]] + w - d[v]) > 1e-9 * (1 + d[v])) bad++;
    }
    for (int64_t k = rowstart[l]; k < rowstart[l + 1]; k++) {
      int64_t u = adj[k];
      if (isinf(d[u]) != isinf(d[v])) bad++;
      else if (!isinf(d[v])) {
        twice++;
        if (d[v] > d[u] + wgt[k] + 1e-9 * (1 + d[v])) bad++;
      }
    }
  }
  int64_t all_bad, all_twice;
  MPI_Allreduce(&bad, &all_bad, 1, MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD);
  MPI_Allreduce(&twice, &all_twice, 1, MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD);
  free(par);
  free(d);
  free(level);
  *edges = all_twice / 2;
  return all_bad;
}

/* Search keys: up to `want` distinct vertices with at least one edge, the same on every rank. */
static int pick_roots(int64_t *roots, int want) {
  int n = 0;
  for (uint64_t t = 0; n < want && t < 64 * (uint64_t)want + 1000; t++) {
    int64_t v = (int64_t)(mix(0x5eed0000 + t) & (uint64_t)(nglobal - 1)), deg = 0, all;
    if (OWNER(v) == rank) deg = rowstart[LOCAL(v) + 1] - rowstart[LOCAL(v)];
    MPI_Allreduce(&deg, &all, 1, MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD);
    int dup = 0;
    for (int i = 0; i < n; i++) dup |= roots[i] == v;
    if (all > 0 && !dup) roots[n++] = v;
  }
  return n;
}

static double harmonic_mean(const double *x, int n) {
  double s = 0;
  for (int i = 0; i < n; i++) s += 1 / x[i];
  return n / s;
}

int main(int argc, char **argv) {
  int want = 64, do_sssp = 1, opt;
  MPI_Init(&argc, &argv);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &nprocs);
  while ((opt = getopt(argc, argv, "s:e:n:S")) != -1) {
    switch (opt) {
      case 's': scale = atoi(optarg); break;
      case 'e': edgefactor = atoi(optarg); break;
      case 'n': want = atoi(optarg); break;
      case 'S': do_sssp = 0; break;
      default: die("usage: graph500 [-s scale] [-e edgefactor] [-n roots<=64] [-S]");
    }
  }
  if (scale < 1 || scale > 40 || want < 1 || want > 64 || (nprocs & (nprocs - 1))) die("bad arguments (ranks: a power of two)");
  nglobal = (int64_t)1 << scale;
  nlocal = nglobal / nprocs;
  MPI_Barrier(MPI_COMM_WORLD);
  double t0 = MPI_Wtime();
  construct();
  MPI_Barrier(MPI_COMM_WORLD);
  double construction = MPI_Wtime() - t0;
  int64_t roots[64];
  int nroots = pick_roots(roots, want);
  int64_t *parent = xmalloc(nlocal * sizeof(int64_t));
  double *dist = xmalloc(nlocal * sizeof(double));
  double bfs_teps[64], sssp_teps[64], bfs_time = 0, sssp_time = 0;
  int64_t bad = 0;
  for (int r = 0; r < nroots; r++) {
    int64_t edges;
    MPI_Barrier(MPI_COMM_WORLD);
    double t = MPI_Wtime();
    bfs(roots[r], parent);
    double dt = MPI_Wtime() - t;
    bfs_time += dt;
    bad += validate_bfs(roots[r], parent, &edges);
    bfs_teps[r] = edges / dt;
    if (!do_sssp) continue;
    MPI_Barrier(MPI_COMM_WORLD);
    t = MPI_Wtime();
    sssp(roots[r], dist, parent, 0.1); /* delta: about 1/average degree of the weights' scale */
    dt = MPI_Wtime() - t;
    sssp_time += dt;
    bad += validate_sssp(roots[r], dist, parent, &edges);
    sssp_teps[r] = edges / dt;
  }
  if (rank == 0) {
    printf("SCALE: %d\nedgefactor: %d\nNBFS: %d\nnum_mpi_processes: %d\n", scale, edgefactor, nroots, nprocs);
    printf("construction_time: %.6f\n", construction);
    printf("bfs_mean_time: %.6f\nbfs_harmonic_mean_TEPS: %.6e\n", bfs_time / nroots, harmonic_mean(bfs_teps, nroots));
    if (do_sssp) printf("sssp_mean_time: %.6f\nsssp_harmonic_mean_TEPS: %.6e\n", sssp_time / nroots, harmonic_mean(sssp_teps, nroots));
    printf("graph500: validation %s (%lld violations over %d roots)\n", bad ? "FAILED" : "passed", (long long)bad, nroots);
  }
  free(parent);
  free(dist);
  free(rowstart);
  free(adj);
  free(wgt);
  MPI_Finalize();
  return bad ? 1 : 0;
}
