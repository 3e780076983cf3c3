package pki

import (
	"crypto/x509"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// testNow is the fixed time every test issues at.
var testNow = time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC)

// fakeClock is a settable clock for the tests.
type fakeClock struct {
	mu sync.Mutex
	t  time.Time
}

func newFakeClock(t time.Time) *fakeClock { return &fakeClock{t: t} }

func (c *fakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *fakeClock) Add(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = c.t.Add(d)
}

func fixedNow() time.Time { return testNow }

// newTestCA makes a CA issuing at testNow.
func newTestCA(t *testing.T) *CA {
	t.Helper()
	ca, err := NewCA(CAOptions{CommonName: "test CA", Now: fixedNow})
	require.NoError(t, err)
	return ca
}

// newTestIntermediate makes a root that allows one intermediate and an
// intermediate signed by it, both issuing at testNow.
func newTestIntermediate(t *testing.T) (root, inter *CA) {
	t.Helper()
	root, err := NewCA(CAOptions{CommonName: "test root", PathLen: 1, Now: fixedNow})
	require.NoError(t, err)
	inter, err = root.NewIntermediate(CAOptions{CommonName: "test intermediate"})
	require.NoError(t, err)
	return root, inter
}

func issueServer(t *testing.T, ca *CA, names ...string) *KeyPair {
	t.Helper()
	kp, err := ca.IssueServer(ServerOptions{DNSNames: names})
	require.NoError(t, err)
	return kp
}

func issueClient(t *testing.T, ca *CA, cluster string) *KeyPair {
	t.Helper()
	id, err := ClusterIdentity("oc.example", cluster)
	require.NoError(t, err)
	kp, err := ca.IssueClient(ClientOptions{Identity: id})
	require.NoError(t, err)
	return kp
}

// writePairFiles writes a key pair into dir and returns the file names.
func writePairFiles(t *testing.T, dir string, kp *KeyPair) (certFile, keyFile string) {
	t.Helper()
	certFile, keyFile = filepath.Join(dir, "tls.crt"), filepath.Join(dir, "tls.key")
	require.NoError(t, kp.WriteFiles(certFile, keyFile))
	return certFile, keyFile
}

func poolOf(certs ...*x509.Certificate) *x509.CertPool {
	p := x509.NewCertPool()
	for _, c := range certs {
		p.AddCert(c)
	}
	return p
}

func fileMode(t *testing.T, name string) os.FileMode {
	t.Helper()
	st, err := os.Stat(name)
	require.NoError(t, err)
	return st.Mode().Perm()
}
