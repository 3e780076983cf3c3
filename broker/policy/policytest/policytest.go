// Package policytest holds policy documents that the tests of the broker's
// packages share: one place for each fixture, so a test of the policy and a
// test of the broker that issues under it read the same document. It
// imports nothing of tokenbroker, so any package's internal tests may use it.
package policytest

import "strings"

// cluster is the cluster every document issues for.
const cluster = `
cluster: {name: east, server: "https://east.example.com:6443", caData: "x"}
`

// westGrants opens Basic, Tenants and Audiences: the cluster, a default
// TTL of 1h (24h at most) and the peer west, up to its list of grants.
const westGrants = cluster + `ttl: {default: 1h, max: 24h}
peers:
  - name: west
    identity: spiffe://oc.example/cluster/west
    grants:
`

// Basic grants west tokens in argo and flux, and north a client certificate.
const Basic = westGrants + `      - namespaces: [argo]
        serviceAccounts: [admiralty-source]
        maxTTL: 12h
        audiences: [aud]
      - namespaces: [argo, flux]
        serviceAccounts: [reader]
  - name: north
    identity: spiffe://oc.example/cluster/north
    grants:
      - namespaces: [argo]
        clusterRole: view
        maxTTL: 30m
        credential: clientCertificate
`

// Tenants grants namespaces by a Capsule tenant label (namespaceSelector).
const Tenants = westGrants + `      - name: oil
        namespaceSelector:
          matchLabels: {capsule.clastix.io/tenant: oil}
        namespaces: [oil-system]
        serviceAccounts: [gitops-reconciler]
        maxTTL: 4h
      - namespaces: [argo]
        serviceAccounts: [gitops-reconciler]
  - name: north
    identity: spiffe://oc.example/cluster/north
    grants:
      - name: oil-north
        namespaceSelector:
          matchLabels: {capsule.clastix.io/tenant: oil}
        serviceAccounts: [gitops-reconciler]
        revokeOnUnmatch: false
`

// Limits sets limits at the top level and for one peer.
const Limits = cluster + `limits: {issuancesPerMinute: 2, burst: 2}
peers:
  - name: west
    identity: spiffe://oc.example/cluster/west
    grants: [{namespaces: [argo], serviceAccounts: [runner]}]
  - name: south
    identity: spiffe://oc.example/cluster/south
    limits: {issuancesPerMinute: 60, burst: 5}
    grants: [{namespaces: [argo], serviceAccounts: [runner]}]
`

// Audiences grants tokens for listed audiences.
const Audiences = westGrants + `      - namespaces: [argo]
        serviceAccounts: [runner]
        maxTTL: 2h
      - namespaces: [vault]
        serviceAccounts: [runner]
        maxTTL: 1h
        audiences: [vault.example, "https://kubernetes.default.svc"]
      - namespaces: [vault]
        serviceAccounts: [runner]
        maxTTL: 12h
`

// TenantUID is the UID of the Tenant that Owned names.
const TenantUID = "6f1f3c1e-2f0e-4a57-9d43-0c6b1f1d2a10"

// Owned is Tenants whose "oil" grant also needs the Tenant.
var Owned = strings.Replace(Tenants, "        namespaces: [oil-system]\n",
	"        namespaceOwner: {apiVersion: capsule.clastix.io/v1beta2, kind: Tenant, name: oil, uid: "+TenantUID+"}\n        namespaces: [oil-system]\n", 1)
