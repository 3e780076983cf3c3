package server

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"slices"

	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/tokenbroker/tokenbroker/pki"
)

// The demo environment of "tokenbroker dev": a dev PKI, demo objects in
// the local cluster and a policy that lets one peer, DevPeer, obtain
// kubeconfigs for DevNamespace/DevServiceAccount (directly, and through
// the lease gateway when the demo runs one).
const (
	DevTrustDomain    = "dev.tokenbroker.local"
	DevPeer           = "west"
	DevNamespace      = "demo"
	DevServiceAccount = "demo"
	// DevRole is the demo Role: what the demo ServiceAccount and the demo
	// client certificates may do.
	DevRole = DevServiceAccount + "-view"
)

// DevFiles are the files of the dev PKI.
type DevFiles struct{ CACert, CAKey, ServerCert, ServerKey, ClientCert, ClientKey string }

// devPKI keeps an existing dev CA (so a browser or script that trusts it
// keeps working) and issues fresh leaf certificates on every start. The
// server certificate is valid for localhost, the loopback addresses and
// the IP of each of listen (the broker's listeners) that is neither
// loopback nor unspecified.
func devPKI(dir string, listen []string) (DevFiles, error) {
	f := DevFiles{
		CACert: filepath.Join(dir, "ca.crt"), CAKey: filepath.Join(dir, "ca.key"),
		ServerCert: filepath.Join(dir, "server.crt"), ServerKey: filepath.Join(dir, "server.key"),
		ClientCert: filepath.Join(dir, DevPeer+".crt"), ClientKey: filepath.Join(dir, DevPeer+".key"),
	}
	ca, err := pki.LoadCA(f.CACert, f.CAKey)
	if errors.Is(err, os.ErrNotExist) {
		ca, err = pki.NewCA(pki.CAOptions{CommonName: "tokenbroker dev CA"})
		if err == nil {
			err = ca.WriteFiles(f.CACert, f.CAKey)
		}
	}
	if err != nil {
		return f, fmt.Errorf("dev CA: %w", err)
	}
	ips := []net.IP{net.IPv4(127, 0, 0, 1), net.IPv6loopback}
	for _, l := range listen {
		if host, _, err := net.SplitHostPort(l); err == nil {
			if ip := net.ParseIP(host); ip != nil && !ip.IsUnspecified() && !ip.IsLoopback() && !slices.ContainsFunc(ips, ip.Equal) {
				ips = append(ips, ip)
			}
		}
	}
	srv, err := ca.IssueServer(pki.ServerOptions{DNSNames: []string{"localhost"}, IPAddresses: ips})
	if err != nil {
		return f, fmt.Errorf("dev server certificate: %w", err)
	}
	if err := srv.WriteFiles(f.ServerCert, f.ServerKey); err != nil {
		return f, err
	}
	id, err := pki.ClusterIdentity(DevTrustDomain, DevPeer)
	if err != nil {
		return f, err
	}
	cli, err := ca.IssueClient(pki.ClientOptions{Identity: id})
	if err != nil {
		return f, fmt.Errorf("dev client certificate: %w", err)
	}
	return f, cli.WriteFiles(f.ClientCert, f.ClientKey)
}

func clusterCAData(rc *rest.Config) ([]byte, error) {
	if len(rc.CAData) > 0 {
		return rc.CAData, nil
	}
	if rc.CAFile != "" {
		return os.ReadFile(rc.CAFile)
	}
	return nil, errors.New("the admin kubeconfig has no certificate-authority; the dev broker needs the cluster's CA")
}

func writeDevPolicy(path, server string, clusterCA []byte, gateway bool) error {
	caFile := filepath.Join(filepath.Dir(path), "cluster-ca.crt")
	if err := os.WriteFile(caFile, clusterCA, 0o644); err != nil {
		return err
	}
	pol := fmt.Sprintf(`# Demo policy written by "tokenbroker dev"; see docs/policy.md.
cluster:
  name: dev
  server: %s
  caFile: cluster-ca.crt
ttl: {default: 1h, max: 24h}
peers:
  - name: %s
    identity: spiffe://%s/cluster/%s
    grants:
      - namespaces: [%s]
        serviceAccounts: [%s]
        maxTTL: 2h
      # A client certificate for a per-lease user who may do what the
      # demo ServiceAccount may (the Role %s); revoked with its lease.
      - namespaces: [%s]
        credential: clientCertificate
        role: %s
        maxTTL: 2h
`, server, DevPeer, DevTrustDomain, DevPeer, DevNamespace, DevServiceAccount, DevRole, DevNamespace, DevRole)
	if gateway {
		// After the direct grant, with the same maxTTL: a request that
		// names no access keeps getting a direct lease (the first of
		// equally generous grants wins).
		pol += fmt.Sprintf(`      # The same ServiceAccount through the lease gateway: a request
      # with "access":"gateway" gets a certificate good only there, and
      # revoking the lease ends its open watches (docs/guides/gateway.md).
      - namespaces: [%s]
        serviceAccounts: [%s]
        access: gateway
        maxTTL: 2h
`, DevNamespace, DevServiceAccount)
	}
	return os.WriteFile(path, []byte(pol), 0o644)
}

// devObjects creates the demo namespace, ServiceAccount, a read-only
// binding and a ConfigMap; existing objects are left as they are.
func devObjects(ctx context.Context, c kubernetes.Interface) error {
	create := func(what string, err error) error {
		if err != nil && !apierrors.IsAlreadyExists(err) {
			return fmt.Errorf("create %s: %w", what, err)
		}
		return nil
	}
	opts := metav1.CreateOptions{}
	_, err := c.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: DevNamespace}}, opts)
	if err := create("namespace", err); err != nil {
		return err
	}
	_, err = c.CoreV1().ServiceAccounts(DevNamespace).Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: DevServiceAccount}}, opts)
	if err := create("ServiceAccount", err); err != nil {
		return err
	}
	// An explicit Role rather than the aggregated "view" ClusterRole, whose
	// rules only exist where the controller manager aggregates them.
	_, err = c.RbacV1().Roles(DevNamespace).Create(ctx, &rbacv1.Role{
		ObjectMeta: metav1.ObjectMeta{Name: DevRole},
		Rules: []rbacv1.PolicyRule{{
			APIGroups: []string{""},
			Resources: []string{"configmaps", "pods", "services"},
			Verbs:     []string{"get", "list", "watch"},
		}},
	}, opts)
	if err := create("Role", err); err != nil {
		return err
	}
	_, err = c.RbacV1().RoleBindings(DevNamespace).Create(ctx, &rbacv1.RoleBinding{
		ObjectMeta: metav1.ObjectMeta{Name: DevRole},
		RoleRef:    rbacv1.RoleRef{APIGroup: "rbac.authorization.k8s.io", Kind: "Role", Name: DevRole},
		Subjects:   []rbacv1.Subject{{Kind: "ServiceAccount", Name: DevServiceAccount, Namespace: DevNamespace}},
	}, opts)
	if err := create("RoleBinding", err); err != nil {
		return err
	}
	_, err = c.CoreV1().ConfigMaps(DevNamespace).Create(ctx, &corev1.ConfigMap{
		ObjectMeta: metav1.ObjectMeta{Name: "hello"},
		Data:       map[string]string{"greeting": "hello from the target cluster"},
	}, opts)
	return create("ConfigMap", err)
}

// DevOptions are what SetUpDev prepares.
type DevOptions struct {
	// Dir holds the dev PKI and the policy.
	Dir string
	// Listen are the broker's listeners' addresses: the server
	// certificate is valid for their IPs besides loopback.
	Listen []string
	// Gateway adds a grant with access gateway for the demo
	// ServiceAccount, for a broker that runs the lease gateway.
	Gateway bool
}

// PrepareDev is SetUpDev for a broker without the lease gateway listening
// on listen.
func PrepareDev(ctx context.Context, client kubernetes.Interface, admin *rest.Config, dir, listen string) (DevFiles, string, error) {
	return SetUpDev(ctx, client, admin, DevOptions{Dir: dir, Listen: []string{listen}})
}

// SetUpDev sets up what a demo broker needs against a local cluster:
// the demo namespace, ServiceAccount, Role and ConfigMap (existing ones
// are kept), a dev PKI in o.Dir (an existing dev CA is kept) and a policy
// that lets the peer DevPeer obtain kubeconfigs for the demo
// ServiceAccount (and, with o.Gateway, gateway leases for it). It returns
// the files and the policy file.
func SetUpDev(ctx context.Context, client kubernetes.Interface, admin *rest.Config, o DevOptions) (DevFiles, string, error) {
	if err := devObjects(ctx, client); err != nil {
		return DevFiles{}, "", err
	}
	files, err := devPKI(o.Dir, o.Listen)
	if err != nil {
		return DevFiles{}, "", err
	}
	clusterCA, err := clusterCAData(admin)
	if err != nil {
		return DevFiles{}, "", err
	}
	policyFile := filepath.Join(o.Dir, "policy.yaml")
	return files, policyFile, writeDevPolicy(policyFile, admin.Host, clusterCA, o.Gateway)
}
