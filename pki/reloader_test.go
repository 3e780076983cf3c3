package pki

import (
	"crypto"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// callbackRecorder collects what a CertReloader reports.
type callbackRecorder struct {
	mu   sync.Mutex
	errs []error
}

func (c *callbackRecorder) record(err error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.errs = append(c.errs, err)
}

func (c *callbackRecorder) all() []error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]error(nil), c.errs...)
}

func servedRaw(t *testing.T, r *CertReloader) []byte {
	t.Helper()
	c, err := r.GetCertificate(nil)
	require.NoError(t, err)
	require.NotNil(t, c)
	cc, err := r.GetClientCertificate(nil)
	require.NoError(t, err)
	require.Same(t, c, cc)
	require.Equal(t, c.Leaf.Raw, c.Certificate[0])
	return c.Certificate[0]
}

func TestNewCertReloaderRefusesBadFiles(t *testing.T) {
	t.Parallel()
	ca := newTestCA(t)
	good := issueServer(t, ca, "broker")
	other := issueServer(t, ca, "broker")
	expired, err := ca.IssueServer(ServerOptions{DNSNames: []string{"broker"}, Lifetime: time.Minute})
	require.NoError(t, err)

	tests := []struct {
		name    string
		cert    []byte
		key     []byte
		wantErr string
	}{
		{name: "A missing certificate file is refused.", cert: nil, key: good.KeyPEM, wantErr: "no such file"},
		{name: "A missing key file is refused.", cert: good.CertPEM, key: nil, wantErr: "no such file"},
		{name: "A key that does not match the certificate is refused.", cert: good.CertPEM, key: other.KeyPEM, wantErr: "does not match"},
		{name: "A garbage certificate is refused.", cert: []byte("garbage"), key: good.KeyPEM, wantErr: "outside PEM blocks"},
		{name: "An expired certificate is refused.", cert: expired.CertPEM, key: expired.KeyPEM, wantErr: "expired"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			dir := t.TempDir()
			certFile, keyFile := filepath.Join(dir, "tls.crt"), filepath.Join(dir, "tls.key")
			if tt.cert != nil {
				require.NoError(t, os.WriteFile(certFile, tt.cert, 0o644))
			}
			if tt.key != nil {
				require.NoError(t, os.WriteFile(keyFile, tt.key, 0o600))
			}
			r, err := NewCertReloader(certFile, keyFile, WithReloadClock(func() time.Time { return testNow.Add(time.Hour) }))
			require.ErrorContains(t, err, tt.wantErr)
			require.Nil(t, r)
		})
	}
}

func TestCertReloader(t *testing.T) {
	t.Parallel()
	ca := newTestCA(t)

	t.Run("New files are served once the interval has passed and the callback reports success.", func(t *testing.T) {
		t.Parallel()
		first, second := issueServer(t, ca, "broker"), issueServer(t, ca, "broker")
		certFile, keyFile := writePairFiles(t, t.TempDir(), first)
		clock := newFakeClock(testNow)
		var rec callbackRecorder
		r, err := NewCertReloader(certFile, keyFile, WithReloadClock(clock.Now), WithReloadCallback(rec.record))
		require.NoError(t, err)
		require.Equal(t, first.Cert.Raw, servedRaw(t, r))
		require.Equal(t, first.Cert.Raw, r.Leaf().Raw)

		require.NoError(t, second.WriteFiles(certFile, keyFile))
		require.Equal(t, first.Cert.Raw, servedRaw(t, r), "files are not read again within the interval")
		clock.Add(DefaultReloadInterval)
		require.Equal(t, second.Cert.Raw, servedRaw(t, r))
		require.Equal(t, []error{nil}, rec.all())

		clock.Add(DefaultReloadInterval)
		require.Equal(t, second.Cert.Raw, servedRaw(t, r))
		require.Equal(t, []error{nil}, rec.all(), "unchanged files are not reported again")
	})

	t.Run("Bad new files keep the old pair in service and the callback gets the error once.", func(t *testing.T) {
		t.Parallel()
		first, second, third := issueServer(t, ca, "broker"), issueServer(t, ca, "broker"), issueServer(t, ca, "broker")
		certFile, keyFile := writePairFiles(t, t.TempDir(), first)
		var rec callbackRecorder
		r, err := NewCertReloader(certFile, keyFile, WithReloadInterval(0), WithReloadClock(fixedNow), WithReloadCallback(rec.record))
		require.NoError(t, err)

		// A new key with the old certificate: the state between the two
		// renames of a rotation.
		require.NoError(t, os.WriteFile(keyFile, second.KeyPEM, 0o600))
		require.Equal(t, first.Cert.Raw, servedRaw(t, r))
		require.Equal(t, first.Cert.Raw, servedRaw(t, r))
		errs := rec.all()
		require.Len(t, errs, 1)
		require.ErrorContains(t, errs[0], "does not match")

		require.NoError(t, os.WriteFile(certFile, []byte("garbage"), 0o644))
		require.Equal(t, first.Cert.Raw, servedRaw(t, r))
		require.Len(t, rec.all(), 2)
		require.ErrorContains(t, rec.all()[1], "outside PEM blocks")

		require.NoError(t, os.Remove(certFile))
		require.Equal(t, first.Cert.Raw, servedRaw(t, r))
		require.Equal(t, first.Cert.Raw, servedRaw(t, r))
		require.Len(t, rec.all(), 3, "a missing file is reported once")
		require.ErrorContains(t, rec.all()[2], "no such file")

		require.NoError(t, third.WriteFiles(certFile, keyFile))
		require.Equal(t, third.Cert.Raw, servedRaw(t, r))
		require.Len(t, rec.all(), 4)
		require.NoError(t, rec.all()[3])
	})

	t.Run("An expired new certificate is refused.", func(t *testing.T) {
		t.Parallel()
		first := issueServer(t, ca, "broker")
		short, err := ca.IssueServer(ServerOptions{DNSNames: []string{"broker"}, Lifetime: time.Minute})
		require.NoError(t, err)
		certFile, keyFile := writePairFiles(t, t.TempDir(), first)
		r, err := NewCertReloader(certFile, keyFile, WithReloadClock(func() time.Time { return testNow.Add(time.Hour) }))
		require.NoError(t, err)
		require.NoError(t, short.WriteFiles(certFile, keyFile))
		require.ErrorContains(t, r.Reload(), "expired")
		require.Equal(t, first.Cert.Raw, servedRaw(t, r))
	})

	t.Run("Reload reads the files at once and reports the outcome.", func(t *testing.T) {
		t.Parallel()
		first, second := issueServer(t, ca, "broker"), issueServer(t, ca, "broker")
		certFile, keyFile := writePairFiles(t, t.TempDir(), first)
		var rec callbackRecorder
		r, err := NewCertReloader(certFile, keyFile, WithReloadClock(fixedNow), WithReloadInterval(time.Hour), WithReloadCallback(rec.record))
		require.NoError(t, err)
		require.NoError(t, r.Reload(), "unchanged files are fine")
		require.Empty(t, rec.all())
		require.NoError(t, second.WriteFiles(certFile, keyFile))
		require.NoError(t, r.Reload())
		require.Equal(t, second.Cert.Raw, servedRaw(t, r))
		require.Equal(t, []error{nil}, rec.all())
	})

	t.Run("A certificate file with a chain serves the whole chain.", func(t *testing.T) {
		t.Parallel()
		kp := issueServer(t, ca, "broker")
		dir := t.TempDir()
		certFile, keyFile := filepath.Join(dir, "tls.crt"), filepath.Join(dir, "tls.key")
		require.NoError(t, os.WriteFile(certFile, append(append([]byte(nil), kp.CertPEM...), ca.CertPEM()...), 0o644))
		require.NoError(t, os.WriteFile(keyFile, kp.KeyPEM, 0o600))
		r, err := NewCertReloader(certFile, keyFile, WithReloadClock(fixedNow))
		require.NoError(t, err)
		c, err := r.GetCertificate(nil)
		require.NoError(t, err)
		require.Equal(t, [][]byte{kp.Cert.Raw, ca.Certificate().Raw}, c.Certificate)
	})

	t.Run("Concurrent handshakes during rotation always get a complete pair.", func(t *testing.T) {
		t.Parallel()
		pairs := []*KeyPair{issueServer(t, ca, "a"), issueServer(t, ca, "b"), issueServer(t, ca, "c")}
		certFile, keyFile := writePairFiles(t, t.TempDir(), pairs[0])
		r, err := NewCertReloader(certFile, keyFile, WithReloadInterval(0), WithReloadClock(fixedNow))
		require.NoError(t, err)
		var wg sync.WaitGroup
		stop := make(chan struct{})
		for range 4 {
			wg.Go(func() {
				for {
					select {
					case <-stop:
						return
					default:
					}
					c, err := r.GetCertificate(nil)
					if err != nil || c == nil || matchKey(c.Leaf, c.PrivateKey.(crypto.Signer)) != nil {
						t.Error("served an incomplete pair")
						return
					}
				}
			})
		}
		for i := range 30 {
			require.NoError(t, pairs[i%len(pairs)].WriteFiles(certFile, keyFile))
		}
		close(stop)
		wg.Wait()
	})
}
