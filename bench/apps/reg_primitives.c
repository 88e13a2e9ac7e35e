/* The primitives behind registration in place (docs/measurements.md, "Memory registration"):
 * memcpy, pwrite to /proc/self/mem, process_vm_writev, and the move of anonymous pages onto a
 * memfd (fallocate + pwrite + mmap MAP_FIXED) per size; reading /proc/self/maps and stat+status;
 * a Unix seqpacket round trip. Build: gcc -O2 -o reg_primitives reg_primitives.c */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <sys/socket.h>
#include <unistd.h>
#include <fcntl.h>
#include <time.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
static void move_to_memfd(char*p,size_t len){int fd=memfd_create("x",0);ftruncate(fd,len);fallocate(fd,0,0,len);pwrite(fd,p,len,0);mmap(p,len,PROT_READ|PROT_WRITE,MAP_SHARED|MAP_FIXED,fd,0);close(fd);}
int main(){
 size_t sizes[]={4096,65536,262144,1<<20,64<<20};
 for(int k=0;k<5;k++){size_t n=sizes[k];int it=n<(1<<20)?200:(n<(8<<20)?50:3);
  double tm=0,tp=0,tv=0,tmv=0;char*src=malloc(n),*dst=malloc(n);memset(src,1,n);memset(dst,2,n);
  int mf=open("/proc/self/mem",O_RDWR);
  for(int i=0;i<it;i++){double t=now();memcpy(dst,src,n);tm+=now()-t;
   t=now();pwrite(mf,src,n,(off_t)dst);tp+=now()-t;
   struct iovec l={src,n},r={dst,n};t=now();process_vm_writev(getpid(),&l,1,&r,1,0);tv+=now()-t;
   char*a=mmap(0,n,PROT_READ|PROT_WRITE,MAP_PRIVATE|MAP_ANONYMOUS,-1,0);memset(a,3,n);t=now();move_to_memfd(a,n);tmv+=now()-t;munmap(a,n);}
  printf("%8zu B: memcpy %.1f us (%.1f GB/s)  /proc/self/mem pwrite %.1f us (%.1f GB/s)  process_vm_writev %.1f us (%.1f GB/s)  move(copy+mmap memfd) %.1f us (%.2f GB/s)\n",n,
   tm/it*1e6,n*it/tm/1e9,tp/it*1e6,n*it/tp/1e9,tv/it*1e6,n*it/tv/1e9,tmv/it*1e6,n*it/tmv/1e9);}
 // proc file reads
 char buf[1<<16];double t=now();for(int i=0;i<200;i++){int f=open("/proc/self/maps",O_RDONLY);while(read(f,buf,sizeof buf)>0);close(f);}printf("read /proc/self/maps: %.1f us\n",(now()-t)/200*1e6);
 t=now();for(int i=0;i<200;i++){int f=open("/proc/self/stat",O_RDONLY);read(f,buf,sizeof buf);close(f);f=open("/proc/self/status",O_RDONLY);read(f,buf,sizeof buf);close(f);}printf("read stat+status: %.1f us\n",(now()-t)/200*1e6);
 // socket round trip 64KiB
 int sv[2];socketpair(AF_UNIX,SOCK_SEQPACKET,0,sv);int sz=1<<20;setsockopt(sv[0],SOL_SOCKET,SO_SNDBUF,&sz,4);setsockopt(sv[1],SOL_SOCKET,SO_SNDBUF,&sz,4);
 static char msg[70000];
 if(fork()==0){for(;;){int r=read(sv[1],msg,sizeof msg);if(r<=0)_exit(0);write(sv[1],msg,8);}}
 for(int s=8;s<=65536;s*=64){t=now();for(int i=0;i<2000;i++){write(sv[0],msg,s);read(sv[0],msg,sizeof msg);}printf("unix seqpacket round trip %d B: %.1f us\n",s,(now()-t)/2000*1e6);}
 close(sv[0]);return 0;}
