//! Which tenant a pod's vNIC belongs to.

use std::collections::HashMap;

/// Where a pod's tenant comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TenantSource {
    /// Every pod gets the default tenant.
    Default,
    /// The pod's namespace is its tenant.
    Namespace,
    /// A namespace → tenant map (`--tenant-map FILE`, a JSON object); namespaces it does not
    /// name get the default tenant.
    NamespaceMap(HashMap<String, String>),
}

/// The tenant policy of the node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TenantPolicy {
    /// Where a pod's tenant comes from.
    pub source: TenantSource,
    /// The tenant of pods `source` names none for, and of every vNIC until its pod is known.
    pub default: String,
}

impl TenantPolicy {
    /// The tenant of a pod in `namespace` (`None`: the pod is not known yet, as in
    /// `Allocate`, which the kubelet calls with device IDs only).
    pub fn tenant(&self, namespace: Option<&str>) -> String {
        match (&self.source, namespace) {
            (TenantSource::Namespace, Some(ns)) => ns.to_string(),
            (TenantSource::NamespaceMap(map), Some(ns)) => map.get(ns).cloned().unwrap_or_else(|| self.default.clone()),
            _ => self.default.clone(),
        }
    }

    /// True when the tenant depends on which pod holds the device (so `PreStartContainer`
    /// must look the pod up).
    pub fn needs_pod(&self) -> bool {
        self.source != TenantSource::Default
    }
}

/// Reads a namespace → tenant map: a JSON object of strings.
pub fn read_map(text: &str) -> Result<HashMap<String, String>, serde_json::Error> {
    serde_json::from_str(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_source_names_the_tenant_it_says() {
        let p = |source| TenantPolicy { source, default: "shared".into() };
        assert_eq!(p(TenantSource::Default).tenant(Some("team-a")), "shared");
        assert_eq!(p(TenantSource::Namespace).tenant(Some("team-a")), "team-a");
        assert_eq!(p(TenantSource::Namespace).tenant(None), "shared");
        let map = read_map(r#"{"team-a": "blue"}"#).unwrap();
        assert_eq!(p(TenantSource::NamespaceMap(map.clone())).tenant(Some("team-a")), "blue");
        assert_eq!(p(TenantSource::NamespaceMap(map)).tenant(Some("team-b")), "shared");
    }
}
