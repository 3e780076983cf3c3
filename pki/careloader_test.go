package pki

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestCAReloaderSwapsToAGoodNewCAAndKeepsTheOldOneOtherwise(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	certFile, keyFile := filepath.Join(dir, "ca.crt"), filepath.Join(dir, "ca.key")
	oldCA, newCA := newTestCA(t), newTestCA(t)
	require.NoError(t, oldCA.WriteFiles(certFile, keyFile))
	var calls callbackRecorder
	now := testNow
	r, err := NewCAReloader(certFile, keyFile, CAOptions{Now: fixedNow},
		WithReloadInterval(0), WithReloadClock(func() time.Time { return now }), WithReloadCallback(calls.record))
	require.NoError(t, err)
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(t, err)
	csr, _, err := ParseCSRPEM(identityCSR(t, key))
	require.NoError(t, err)
	signedBy := func() *x509.Certificate {
		t.Helper()
		kp, err := r.SignClient(csr, testIdentity, time.Hour)
		require.NoError(t, err)
		require.NoError(t, kp.Cert.CheckSignatureFrom(r.Certificate()))
		return r.Certificate()
	}
	require.Equal(t, oldCA.Certificate().Raw, signedBy().Raw)
	require.Empty(t, calls.all(), "the first load is not a reload")

	t.Run("A key that does not match is refused and the old CA signs on.", func(t *testing.T) {
		other, err := newCA.KeyPEM()
		require.NoError(t, err)
		writeFile(t, keyFile, other)
		require.ErrorContains(t, r.Reload(), "does not match")
		require.Equal(t, oldCA.Certificate().Raw, signedBy().Raw)
	})
	t.Run("Garbage is refused and the old CA signs on.", func(t *testing.T) {
		writeFile(t, certFile, []byte("not PEM"))
		require.Error(t, r.Reload())
		require.Equal(t, oldCA.Certificate().Raw, signedBy().Raw)
	})
	t.Run("A certificate that is not a CA is refused.", func(t *testing.T) {
		leaf := issueServer(t, oldCA, "broker")
		writeFile(t, certFile, leaf.CertPEM)
		writeFile(t, keyFile, leaf.KeyPEM)
		require.ErrorContains(t, r.Reload(), "not a CA certificate")
		require.Equal(t, oldCA.Certificate().Raw, signedBy().Raw)
	})
	t.Run("An expired CA is refused.", func(t *testing.T) {
		now = newCA.Certificate().NotAfter.Add(time.Second)
		require.NoError(t, newCA.ReplaceFiles(certFile, keyFile))
		require.ErrorContains(t, r.Reload(), "expired")
		now = testNow
		require.Equal(t, oldCA.Certificate().Raw, r.Certificate().Raw)
	})
	t.Run("A good new CA goes into service; the next call signs with it.", func(t *testing.T) {
		other := newTestCA(t)
		require.NoError(t, other.ReplaceFiles(certFile, keyFile))
		require.NoError(t, r.Reload())
		require.Equal(t, other.Certificate().Raw, signedBy().Raw)
	})
	errs := calls.all()
	require.Len(t, errs, 5, "every changed content is reported once")
	require.NoError(t, errs[4])
}

func writeFile(t *testing.T, name string, data []byte) {
	t.Helper()
	require.NoError(t, WriteFileAtomic(name, data, 0o600))
}
