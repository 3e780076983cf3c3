package integration

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"io"
	"log"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"
	"go.uber.org/zap"
	certificatesv1 "k8s.io/api/certificates/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/tokenbroker/tokenbroker/agent"
	"github.com/tokenbroker/tokenbroker/agent/config"
	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/broker/enrollment"
	"github.com/tokenbroker/tokenbroker/broker/objects"
	"github.com/tokenbroker/tokenbroker/pki"
	"github.com/tokenbroker/tokenbroker/test/testcluster"
)

const (
	ctbSigner = "tokenbroker.io/east"
	ctbName   = "tokenbroker.io:east:trust-bundle"
)

// TestClusterTrustBundle runs, on the 1.37 harness, a broker that publishes
// its CAs as a signer-linked ClusterTrustBundle and an agent that trusts
// brokers through such bundles only.
func TestClusterTrustBundle(t *testing.T) {
	c := testcluster.Start(t)
	ctx := context.Background()

	// make test-compat: the oldest supported releases serve only the
	// beta, off by default; the feature is for 1.37 and later.
	requireServedFrom(t, c, 37, "certificates.k8s.io/v1", "clustertrustbundles")

	_, err := c.Client.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "argo"}}, metav1.CreateOptions{})
	require.NoError(t, err)
	_, err = c.Client.CoreV1().ServiceAccounts("argo").Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "runner"}}, metav1.CreateOptions{})
	require.NoError(t, err)
	s := startStack(t, c, grants, withPublishedTrustBundle(ctbSigner))
	bundles := c.Client.CertificatesV1().ClusterTrustBundles()

	// A partner's CA, which the broker trusts for its clients only.
	partner, err := pki.NewCA(pki.CAOptions{CommonName: "partner"})
	require.NoError(t, err)
	withPartner := append(append([]byte(nil), s.ca.BundlePEM()...), partner.CertPEM()...)

	t.Run("TestClusterTrustBundleIsPublishedAndFollowsTheCAFiles", func(t *testing.T) {
		waitForBundle(t, bundles, s.ca.CertPEM())
		b, err := bundles.Get(ctx, ctbName, metav1.GetOptions{})
		require.NoError(t, err)
		require.Equal(t, ctbSigner, b.Spec.SignerName)
		require.Equal(t, objects.ManagedByValue, b.Labels[objects.LabelManagedBy])
		require.Equal(t, "east", b.Annotations[enrollment.AnnotationBroker])

		// A rotation names the other CA in --previous-ca-cert-file: it
		// is published beside the signing CA. The partner CA added to
		// the client-CA bundle at the same time is not.
		next, err := pki.NewCA(pki.CAOptions{CommonName: "east next"})
		require.NoError(t, err)
		writeFileAtomic(t, s.clientCAFile, withPartner)
		writeFileAtomic(t, s.previousCAFile, next.CertPEM())
		both := append(append([]byte(nil), s.ca.CertPEM()...), next.CertPEM()...)
		waitForBundle(t, bundles, both)
		waitForClientCA(t, s, partner)
		requireBundleStays(t, bundles, both)

		writeFileAtomic(t, s.previousCAFile, s.ca.CertPEM())
		writeFileAtomic(t, s.clientCAFile, s.ca.BundlePEM())
		waitForBundle(t, bundles, s.ca.CertPEM())
	})

	t.Run("TestClusterTrustBundleBrokerRBACIsExactlyEnough", func(t *testing.T) {
		// The rules of deploy/components/cluster-trust-bundle (and the
		// chart; test/e2e holds them equal) for signer tokenbroker.io/rbac.
		const signer, name = "tokenbroker.io/rbac", "tokenbroker.io:rbac:trust-bundle"
		grantTo(t, c, "ctb-broker", "ctb-broker",
			rbacv1.PolicyRule{APIGroups: []string{"certificates.k8s.io"}, Resources: []string{"clustertrustbundles"}, Verbs: []string{"create"}},
			rbacv1.PolicyRule{APIGroups: []string{"certificates.k8s.io"}, Resources: []string{"clustertrustbundles"}, ResourceNames: []string{name}, Verbs: []string{"get", "update"}},
			rbacv1.PolicyRule{APIGroups: []string{"certificates.k8s.io"}, Resources: []string{"signers"}, ResourceNames: []string{signer}, Verbs: []string{"attest"}})
		as := impersonate(t, c, "ctb-broker").CertificatesV1().ClusterTrustBundles()
		cas := []*x509.Certificate{s.ca.Certificate()}
		pub, err := enrollment.NewClusterTrustBundlePublisher(enrollment.ClusterTrustBundleConfig{Client: as, SignerName: signer, Owner: "rbac",
			Bundle: func() []*x509.Certificate { return cas }})
		require.NoError(t, err)
		require.Eventually(t, func() bool { return pub.Sync(ctx) == nil }, 10*time.Second, 100*time.Millisecond, "created with these rules")
		next, err := pki.NewCA(pki.CAOptions{CommonName: "rbac next"})
		require.NoError(t, err)
		cas = append(cas, next.Certificate())
		require.NoError(t, pub.Sync(ctx), "updated with these rules")
		got, err := bundles.Get(ctx, name, metav1.GetOptions{})
		require.NoError(t, err)
		require.Equal(t, string(pki.EncodeCertificatesPEM(cas)), got.Spec.TrustBundle)

		// Nothing else: no other bundle can be read or rewritten, none
		// listed, none created for another signer.
		_, err = as.Get(ctx, ctbName, metav1.GetOptions{})
		require.True(t, apierrors.IsForbidden(err), "%v", err)
		other, err := bundles.Get(ctx, ctbName, metav1.GetOptions{})
		require.NoError(t, err)
		other.Spec.TrustBundle = string(next.CertPEM())
		_, err = as.Update(ctx, other, metav1.UpdateOptions{})
		require.True(t, apierrors.IsForbidden(err), "%v", err)
		_, err = as.List(ctx, metav1.ListOptions{})
		require.True(t, apierrors.IsForbidden(err), "%v", err)
		_, err = as.Create(ctx, &certificatesv1.ClusterTrustBundle{ObjectMeta: metav1.ObjectMeta{Name: "tokenbroker.io:east:rbac"},
			Spec: certificatesv1.ClusterTrustBundleSpec{SignerName: ctbSigner, TrustBundle: string(next.CertPEM())}}, metav1.CreateOptions{})
		require.True(t, apierrors.IsForbidden(err), "another signer's: %v", err)
		require.NoError(t, bundles.Delete(ctx, name, metav1.DeleteOptions{}))
	})

	t.Run("TestClusterTrustBundleNeedsAttestOnTheSigner", func(t *testing.T) {
		mallory := impersonate(t, c, "mallory")
		grant(t, c, "mallory-ctb", rbacv1.PolicyRule{APIGroups: []string{"certificates.k8s.io"}, Resources: []string{"clustertrustbundles"}, Verbs: []string{"create", "get", "list", "update", "delete"}})
		attacker, err := pki.NewCA(pki.CAOptions{CommonName: "attacker"})
		require.NoError(t, err)
		evil := &certificatesv1.ClusterTrustBundle{
			ObjectMeta: metav1.ObjectMeta{Name: "tokenbroker.io:east:mallory"},
			Spec:       certificatesv1.ClusterTrustBundleSpec{SignerName: ctbSigner, TrustBundle: string(attacker.CertPEM())},
		}
		_, err = mallory.CertificatesV1().ClusterTrustBundles().Create(ctx, evil, metav1.CreateOptions{})
		require.True(t, apierrors.IsForbidden(err), "without attest on the signer: %v", err)
		require.ErrorContains(t, err, "not permitted to attest")
		// Updating the broker's own bundle is refused too.
		own, err := mallory.CertificatesV1().ClusterTrustBundles().Get(ctx, ctbName, metav1.GetOptions{})
		require.NoError(t, err)
		own.Spec.TrustBundle = string(attacker.CertPEM())
		_, err = mallory.CertificatesV1().ClusterTrustBundles().Update(ctx, own, metav1.UpdateOptions{})
		require.True(t, apierrors.IsForbidden(err), "%v", err)
		// What create alone allows: a bundle without a signer, which the
		// agent never reads (below).
		_, err = mallory.CertificatesV1().ClusterTrustBundles().Create(ctx, &certificatesv1.ClusterTrustBundle{
			ObjectMeta: metav1.ObjectMeta{Name: "mallory-unsigned"},
			Spec:       certificatesv1.ClusterTrustBundleSpec{TrustBundle: string(attacker.CertPEM())},
		}, metav1.CreateOptions{})
		require.NoError(t, err)
		// With attest on exactly this signer the write is admitted.
		grant(t, c, "mallory-attest", rbacv1.PolicyRule{APIGroups: []string{"certificates.k8s.io"}, Resources: []string{"signers"}, ResourceNames: []string{ctbSigner}, Verbs: []string{"attest"}})
		require.Eventually(t, func() bool {
			_, err := mallory.CertificatesV1().ClusterTrustBundles().Create(ctx, evil, metav1.CreateOptions{})
			return err == nil
		}, 10*time.Second, 100*time.Millisecond)
		require.NoError(t, bundles.Delete(ctx, evil.Name, metav1.DeleteOptions{}))
	})

	t.Run("TestClusterTrustBundleAgentTrustsOnlyTheSignersBundles", func(t *testing.T) {
		waitForBundle(t, bundles, s.ca.CertPEM())
		attacker, err := pki.NewCA(pki.CAOptions{CommonName: "attacker"})
		require.NoError(t, err)
		// An admin can write anything; what matters is that the agent
		// reads only bundles of its signer. Unsigned, and another signer's:
		for _, b := range []*certificatesv1.ClusterTrustBundle{
			{ObjectMeta: metav1.ObjectMeta{Name: "attacker-unsigned", Labels: map[string]string{objects.LabelManagedBy: objects.ManagedByValue}},
				Spec: certificatesv1.ClusterTrustBundleSpec{TrustBundle: string(attacker.CertPEM())}},
			{ObjectMeta: metav1.ObjectMeta{Name: "tokenbroker.io:west:trust-bundle", Labels: map[string]string{objects.LabelManagedBy: objects.ManagedByValue}},
				Spec: certificatesv1.ClusterTrustBundleSpec{SignerName: "tokenbroker.io/west", TrustBundle: string(attacker.CertPEM())}},
		} {
			_, err := bundles.Create(ctx, b, metav1.CreateOptions{})
			require.NoError(t, err)
		}
		// The partner CA is in the broker's client-CA bundle, for its
		// clients; a partner can issue itself a server certificate for
		// the broker's address.
		writeFileAtomic(t, s.clientCAFile, withPartner)
		t.Cleanup(func() { writeFileAtomic(t, s.clientCAFile, s.ca.BundlePEM()) })
		waitForClientCA(t, s, partner)
		// Broker impostors whose certificates chain to the attacker CA
		// and to the partner CA.
		var impostorRequests atomic.Int64
		impostor := startImpostor(t, attacker, &impostorRequests)
		partnerImpostor := startImpostor(t, partner, &impostorRequests)

		// The agent's identity: a certificate from the broker's CA, and a
		// ca.crt that trusts neither broker, so that only the bundles can
		// make the real one trusted.
		dir := t.TempDir()
		idDir := agent.IdentityDir(filepath.Join(dir, "identity"))
		require.NoError(t, os.MkdirAll(string(idDir), 0o700))
		client, err := s.ca.IssueClient(pki.ClientOptions{Identity: identity(t, "west")})
		require.NoError(t, err)
		unrelated, err := pki.NewCA(pki.CAOptions{CommonName: "unrelated"})
		require.NoError(t, err)
		require.NoError(t, os.WriteFile(idDir.Cert(), client.CertPEM, 0o600))
		require.NoError(t, os.WriteFile(idDir.Key(), client.KeyPEM, 0o600))
		require.NoError(t, os.WriteFile(idDir.Bundle(), unrelated.CertPEM(), 0o600))

		out := filepath.Join(dir, "out")
		require.NoError(t, os.MkdirAll(out, 0o700))
		target := func(name, url string) config.TargetConfig {
			return config.TargetConfig{Name: name, Broker: url,
				Request: config.RequestConfig{Namespace: "argo", ServiceAccount: "runner", TTL: "1h"},
				Outputs: []config.OutputConfig{{File: &config.FileOutput{Path: filepath.Join(out, name)}}}}
		}
		cfg := config.Config{
			Identity: config.IdentityConfig{Dir: string(idDir), TrustBundleFrom: &config.TrustBundleSource{
				ClusterTrustBundle: &config.ClusterTrustBundleSource{SignerName: ctbSigner, Interval: apiv1.Duration(time.Second),
					LabelSelector: &metav1.LabelSelector{MatchLabels: map[string]string{objects.LabelManagedBy: objects.ManagedByValue}}}}},
			Targets: []config.TargetConfig{target("east", s.url), target("impostor", impostor.URL), target("partner", partnerImpostor.URL)},
			Refresh: config.RefreshConfig{MinBackoff: apiv1.Duration(200 * time.Millisecond), MaxBackoff: apiv1.Duration(time.Second)},
		}
		reg := prometheus.NewRegistry()
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		require.NoError(t, err)
		a, err := agent.New(cfg, agent.Deps{Kubernetes: c.Client, Registry: reg, OpsListener: ln, Logger: zap.NewNop()})
		require.NoError(t, err)
		actx, cancel := context.WithCancel(ctx)
		done := make(chan error, 1)
		go func() { done <- a.Run(actx) }()
		t.Cleanup(func() { cancel(); require.NoError(t, <-done) })

		require.Eventually(t, func() bool {
			_, err := os.Stat(filepath.Join(out, "east"))
			return err == nil
		}, 30*time.Second, 100*time.Millisecond, "the agent fetches a kubeconfig from the broker it trusts through the bundle")
		require.Eventually(t, func() bool {
			return refreshFailures(t, reg, "impostor") >= 2 && refreshFailures(t, reg, "partner") >= 2
		}, 30*time.Second, 100*time.Millisecond)
		require.Zero(t, impostorRequests.Load(), "the impostors' certificates chain to a CA only unsigned or foreign bundles hold, or to a partner CA the broker does not publish")
		for _, name := range []string{"impostor", "partner"} {
			_, err = os.Stat(filepath.Join(out, name))
			require.True(t, os.IsNotExist(err), name)
		}
		requireBundleStays(t, bundles, s.ca.CertPEM())
	})
}

// startImpostor serves, on 127.0.0.1, a certificate from ca, counting the
// requests that get through.
func startImpostor(t *testing.T, ca *pki.CA, requests *atomic.Int64) *httptest.Server {
	t.Helper()
	kp, err := ca.IssueServer(pki.ServerOptions{IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1)}})
	require.NoError(t, err)
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		requests.Add(1)
		w.WriteHeader(http.StatusTeapot)
	}))
	pair, err := kp.TLSCertificate()
	require.NoError(t, err)
	srv.TLS = &tls.Config{Certificates: []tls.Certificate{pair}, MinVersion: tls.VersionTLS13}
	srv.Config.ErrorLog = log.New(io.Discard, "", 0) // its refused handshakes are expected
	srv.StartTLS()
	t.Cleanup(srv.Close)
	return srv
}

// waitForClientCA polls until the broker accepts a client certificate from
// ca: it has reloaded a client-CA bundle that holds it.
func waitForClientCA(t *testing.T, s *stack, ca *pki.CA) {
	t.Helper()
	c := s.clientFrom(t, ca, "partner", s.ca.CertPool())
	require.Eventually(t, func() bool {
		resp, err := c.Get(s.url + "/v1/whoami")
		if err != nil {
			return false
		}
		_ = resp.Body.Close()
		return true
	}, 20*time.Second, 100*time.Millisecond, "the broker takes the client-CA bundle with %s", ca.Certificate().Subject.CommonName)
}

// requireBundleStays checks, over a few of the broker's checks, that its
// bundle holds exactly want.
func requireBundleStays(t *testing.T, bundles interface {
	Get(context.Context, string, metav1.GetOptions) (*certificatesv1.ClusterTrustBundle, error)
}, want []byte) {
	t.Helper()
	wantCerts, err := pki.ParseCertificatesPEM(want)
	require.NoError(t, err)
	wantPEM := string(pki.EncodeCertificatesPEM(wantCerts))
	require.Never(t, func() bool {
		b, err := bundles.Get(context.Background(), ctbName, metav1.GetOptions{})
		return err != nil || b.Spec.TrustBundle != wantPEM
	}, 3*enrollment.DefaultBundleCheckInterval, 100*time.Millisecond, "the ClusterTrustBundle holds exactly what anchors the broker")
}

// waitForBundle polls until the broker's bundle holds exactly want.
func waitForBundle(t *testing.T, bundles interface {
	Get(context.Context, string, metav1.GetOptions) (*certificatesv1.ClusterTrustBundle, error)
}, want []byte) {
	t.Helper()
	wantCerts, err := pki.ParseCertificatesPEM(want)
	require.NoError(t, err)
	wantPEM := string(pki.EncodeCertificatesPEM(wantCerts))
	var last string
	require.Eventually(t, func() bool {
		b, err := bundles.Get(context.Background(), ctbName, metav1.GetOptions{})
		if err != nil {
			return false
		}
		last = b.Spec.TrustBundle
		return last == wantPEM
	}, 20*time.Second, 100*time.Millisecond, "the ClusterTrustBundle holds %q", last)
}

func impersonate(t *testing.T, c *testcluster.Cluster, user string) kubernetes.Interface {
	t.Helper()
	rc := rest.CopyConfig(c.Config)
	rc.Impersonate = rest.ImpersonationConfig{UserName: user}
	k, err := kubernetes.NewForConfig(rc)
	require.NoError(t, err)
	return k
}

// grant binds a ClusterRole with rule to the user mallory.
func grant(t *testing.T, c *testcluster.Cluster, name string, rule rbacv1.PolicyRule) {
	t.Helper()
	grantTo(t, c, name, "mallory", rule)
}

// grantTo binds a ClusterRole with rules to user.
func grantTo(t *testing.T, c *testcluster.Cluster, name, user string, rules ...rbacv1.PolicyRule) {
	t.Helper()
	ctx := context.Background()
	_, err := c.Client.RbacV1().ClusterRoles().Create(ctx, &rbacv1.ClusterRole{ObjectMeta: metav1.ObjectMeta{Name: name}, Rules: rules}, metav1.CreateOptions{})
	require.NoError(t, err)
	_, err = c.Client.RbacV1().ClusterRoleBindings().Create(ctx, &rbacv1.ClusterRoleBinding{ObjectMeta: metav1.ObjectMeta{Name: name},
		RoleRef:  rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "ClusterRole", Name: name},
		Subjects: []rbacv1.Subject{{Kind: rbacv1.UserKind, APIGroup: rbacv1.GroupName, Name: user}}}, metav1.CreateOptions{})
	require.NoError(t, err)
	// Wait until the authorizer allows each rule.
	for _, r := range rules {
		require.NoError(t, testcluster.WaitAllowed(ctx, c.Client, user, nil, testcluster.RuleAttributes(r, "")))
	}
}

func refreshFailures(t *testing.T, reg *prometheus.Registry, target string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		if mf.GetName() != "tokenbroker_agent_refresh_total" {
			continue
		}
		for _, m := range mf.GetMetric() {
			var tgt, res string
			for _, l := range m.GetLabel() {
				switch l.GetName() {
				case "target":
					tgt = l.GetValue()
				case "result":
					res = l.GetValue()
				}
			}
			if tgt == target && res == "failure" {
				return m.GetCounter().GetValue()
			}
		}
	}
	return 0
}

// requireServedFrom skips the test on a Kubernetes release before minor
// (1.<minor>), after checking that it does not serve resource at
// groupVersion, and otherwise requires that it does: a feature the test
// needs is GA from that release, beta and off by default before it.
func requireServedFrom(t *testing.T, c *testcluster.Cluster, minor int, groupVersion, resource string) {
	t.Helper()
	v, err := c.Client.Discovery().ServerVersion()
	require.NoError(t, err)
	got, err := strconv.Atoi(strings.TrimRight(v.Minor, "+"))
	require.NoError(t, err, "minor version %q", v.Minor)
	res, err := c.Client.Discovery().ServerResourcesForGroupVersion(groupVersion)
	require.NoError(t, err, "%s is served", groupVersion)
	served := false
	for _, r := range res.APIResources {
		served = served || r.Name == resource
	}
	if got < minor {
		require.False(t, served, "Kubernetes %s does not serve %s at %s", v.GitVersion, resource, groupVersion)
		t.Skipf("%s (%s) needs Kubernetes 1.%d; this API server is %s", resource, groupVersion, minor, v.GitVersion)
	}
	require.True(t, served, "%s is served at %s by default", resource, groupVersion)
}
