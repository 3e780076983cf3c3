package execcred

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/json"
	"encoding/pem"
	"errors"
	"math/big"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
)

// testCAPEM returns a self-signed CA certificate in PEM named cn.
func testCAPEM(t testing.TB, cn string) []byte {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(t, err)
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: cn}, IsCA: true, BasicConstraintsValid: true,
		NotBefore: t0.Add(-time.Hour), NotAfter: t0.Add(24 * time.Hour)}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	require.NoError(t, err)
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})
}

func TestCheckClusterIsTheTokenTheftGuard(t *testing.T) {
	t.Parallel()
	ca, other := testCAPEM(t, "east"), testCAPEM(t, "mallory")
	want := ClusterRef{Server: "https://east.example.com:6443", CAData: ca}
	bundle := append(append([]byte{}, other...), ca...)
	for _, tc := range []struct {
		name string
		got  Cluster
		ok   bool
	}{
		{"the broker's server and CA pass", Cluster{Server: "https://east.example.com:6443", CAData: ca}, true},
		{"the same server spelt with upper case and a trailing slash passes", Cluster{Server: "https://EAST.example.com:6443/", CAData: ca}, true},
		{"the same CA with other PEM whitespace passes", Cluster{Server: want.Server, CAData: append([]byte("\n\n"), ca...)}, true},
		{"another server is refused", Cluster{Server: "https://mallory.example.com:6443", CAData: ca}, false},
		{"another port is refused", Cluster{Server: "https://east.example.com:443", CAData: ca}, false},
		{"plain http is refused", Cluster{Server: "http://east.example.com:6443", CAData: ca}, false},
		{"a path prefix the broker did not name is refused", Cluster{Server: "https://east.example.com:6443/proxy", CAData: ca}, false},
		{"userinfo in the URL is refused", Cluster{Server: "https://u@east.example.com:6443", CAData: ca}, false},
		{"another CA is refused", Cluster{Server: want.Server, CAData: other}, false},
		{"a bundle that adds a CA is refused", Cluster{Server: want.Server, CAData: bundle}, false},
		{"no CA (the system roots) is refused", Cluster{Server: want.Server}, false},
		{"a CA that is not PEM is refused", Cluster{Server: want.Server, CAData: []byte("garbage")}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			err := CheckCluster(tc.got, want)
			if tc.ok {
				require.NoError(t, err)
				return
			}
			require.ErrorIs(t, err, ErrClusterMismatch)
		})
	}
	t.Run("a broker cluster without a CA matches nothing", func(t *testing.T) {
		t.Parallel()
		require.ErrorIs(t, CheckCluster(Cluster{Server: want.Server}, ClusterRef{Server: want.Server}), ErrClusterMismatch)
	})
	t.Run("a default https port equals an explicit 443", func(t *testing.T) {
		t.Parallel()
		require.NoError(t, CheckCluster(Cluster{Server: "https://east.example.com", CAData: ca}, ClusterRef{Server: "https://east.example.com:443", CAData: ca}))
	})
}

func TestGuardedPluginHandsOutOnlyForTheBrokersCluster(t *testing.T) {
	t.Parallel()
	ca := testCAPEM(t, "east")
	east := ClusterRef{Server: "https://east.example.com:6443", CAData: ca}
	guard := func(got Cluster) func(*Credential) error {
		return func(c *Credential) error { return CheckCluster(got, *c.Cluster) }
	}
	issueFor := func(f *pluginFixture, cluster *ClusterRef) IssueFunc {
		return func(ctx context.Context) (*Credential, error) {
			c, err := f.issuer.issue(ctx)
			if err == nil {
				c.Cluster = cluster
			}
			return c, err
		}
	}

	t.Run("a right cluster gets the credential, cached, and a hit for it is checked again", func(t *testing.T) {
		t.Parallel()
		f := newPluginFixture(t)
		f.p.Guard = guard(Cluster{Server: east.Server, CAData: ca})
		c, out, err := f.p.Get(context.Background(), testKey, Parent{}, issueFor(f, &east))
		require.NoError(t, err)
		require.Equal(t, OutcomeMiss, out)
		require.Equal(t, &east, c.Cluster)
		_, out, err = f.p.Get(context.Background(), testKey, Parent{}, issueFor(f, &east))
		require.NoError(t, err)
		require.Equal(t, OutcomeHit, out)

		// The same cache asked for another server: the cached credential
		// stays (it is good for east) but is not handed out.
		f.p.Guard = guard(Cluster{Server: "https://mallory.example.com:6443", CAData: ca})
		c, _, err = f.p.Get(context.Background(), testKey, Parent{}, issueFor(f, &east))
		require.ErrorIs(t, err, ErrClusterMismatch)
		require.Nil(t, c)
		require.Equal(t, 1, f.issuer.issued())
	})

	t.Run("a newly issued credential for another cluster is not handed out", func(t *testing.T) {
		t.Parallel()
		f := newPluginFixture(t)
		f.p.Guard = guard(Cluster{Server: "https://mallory.example.com:6443", CAData: ca})
		c, _, err := f.p.Get(context.Background(), testKey, Parent{}, issueFor(f, &east))
		require.ErrorIs(t, err, ErrClusterMismatch)
		require.Nil(t, c)
	})

	t.Run("an answer without its cluster is refused under the guard", func(t *testing.T) {
		t.Parallel()
		f := newPluginFixture(t)
		f.p.Guard = guard(Cluster{Server: east.Server, CAData: ca})
		_, _, err := f.p.Get(context.Background(), testKey, Parent{}, f.issuer.issue)
		require.ErrorIs(t, err, ErrClusterMismatch)
	})

	t.Run("an entry cached without the guard is replaced, not handed out", func(t *testing.T) {
		t.Parallel()
		f := newPluginFixture(t)
		_, _, err := f.p.Get(context.Background(), testKey, Parent{}, f.issuer.issue)
		require.NoError(t, err)
		f.p.Guard = guard(Cluster{Server: east.Server, CAData: ca})
		c, out, err := f.p.Get(context.Background(), testKey, Parent{}, issueFor(f, &east))
		require.NoError(t, err)
		require.Equal(t, OutcomeMiss, out)
		require.Equal(t, 2, f.issuer.issued())
		require.Equal(t, &east, c.Cluster)
	})

	t.Run("a refusal at the refresh point is not turned into a stale hand-out", func(t *testing.T) {
		t.Parallel()
		f := newPluginFixture(t)
		f.p.Guard = guard(Cluster{Server: east.Server, CAData: ca})
		_, _, err := f.p.Get(context.Background(), testKey, Parent{}, issueFor(f, &east))
		require.NoError(t, err)
		f.clock.Step(50 * time.Minute) // past the refresh point, before expiry
		refused := func(context.Context) (*Credential, error) { return nil, errors.Join(ErrClusterMismatch) }
		_, _, err = f.p.Get(context.Background(), testKey, Parent{}, refused)
		require.ErrorIs(t, err, ErrClusterMismatch)
	})
}

// The target a ClusterProfile entry carries round-trips with its access
// mode: what the agent writes is what the plugin asks the broker for.
func TestAPluginTargetKeepsItsAccessMode(t *testing.T) {
	t.Parallel()
	spec := apiv1.RequestSpec{Namespace: "batch", ServiceAccount: "mk", TTL: "1h", Access: apiv1.AccessGateway}
	raw, err := json.Marshal(NewPluginTarget("https://b:8443", spec))
	require.NoError(t, err)
	require.Contains(t, string(raw), `"access":"gateway"`)
	got, err := ParsePluginTarget(raw)
	require.NoError(t, err)
	require.Equal(t, spec.Request(), got.Request())

	spec.Access = ""
	raw, err = json.Marshal(NewPluginTarget("https://b:8443", spec))
	require.NoError(t, err)
	require.NotContains(t, string(raw), "access", "an entry without a mode is the entry of earlier releases")
}
