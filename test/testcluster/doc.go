// Package testcluster runs a real, throw-away Kubernetes control plane for
// tests: a kube-apiserver child process backed by an etcd server embedded in
// the calling process, optionally with a kube-controller-manager that runs
// only the certificate (CSR) controllers.
//
// tokenbroker's behaviour is decided by the API server (TokenRequest, token
// expiry clamping, bound-object revocation, RBAC, CSR signing), so tests must
// talk to a real one rather than client-go's fake clientset. A cluster is
// private to its caller: it listens only on 127.0.0.1 on free ports, keeps
// all state (certificates, keys, etcd data, logs) in its own temporary
// directory and removes it on Stop, so several clusters can run at once in
// one test binary and in parallel test packages.
//
// The binaries come from the Kubernetes release $KUBE_VERSION names (default
// DefaultKubeVersion), each pinned by a module of its own in
// test/kube/<version>. They are looked up in kube/<version> under
// $TOKENBROKER_BIN_DIR, else under bin/ at the repository root, and built
// there with `go build` (under a file lock) when missing. The Makefile runs
// `go run ./cmd/kubebins` in test/ before the tests (EnsureBinaries), which
// also replaces binaries built from an older go.mod.
//
// Use Start from tests and Run from programs:
//
//	c := testcluster.Start(t, testcluster.WithMaxTokenExpiration(time.Hour))
//	sa, err := c.Client.CoreV1().ServiceAccounts("default").Create(...)
//
// What is (and is not) there: the API server runs with RBAC authorization,
// the default admission plugins and its bootstrap RBAC policy; there are no
// nodes, no scheduler and, unless WithControllerManager asks for them, no
// controllers. In particular no namespace controller (deleted namespaces stay
// Terminating), no token controller, and no ClusterRole aggregation: the
// aggregated roles admin, edit and view exist with no rules, so tests should
// bind their own Roles (or system:aggregate-to-edit and friends), or add
// "clusterrole-aggregation" to WithControllerManager.
//
// Logs of the kube-apiserver, the controller manager and etcd go to files in
// Cluster.Dir, never to the test output; a failed start includes the tail of
// the relevant log in its error.
package testcluster
