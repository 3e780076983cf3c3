package pki

import (
	"crypto/tls"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// bootstrapServer serves bundle over TLS with a server certificate from ca
// for 127.0.0.1.
func bootstrapServer(t *testing.T, ca *CA, bundle []byte) *httptest.Server {
	t.Helper()
	kp, err := ca.IssueServer(ServerOptions{IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1)}})
	require.NoError(t, err)
	cert, err := kp.TLSCertificate()
	require.NoError(t, err)
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		_, _ = w.Write(bundle)
	}))
	srv.TLS = &tls.Config{MinVersion: tls.VersionTLS13, Certificates: []tls.Certificate{cert}}
	srv.StartTLS()
	t.Cleanup(srv.Close)
	return srv
}

// fetch makes the bootstrap request and returns the body and the host.
func fetch(t *testing.T, b *Bootstrap, url string) []byte {
	t.Helper()
	hc := &http.Client{Transport: &http.Transport{TLSClientConfig: b.Config()}}
	defer hc.CloseIdleConnections()
	resp, err := hc.Get(url)
	require.NoError(t, err)
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return body
}

func TestBootstrap(t *testing.T) {
	t.Parallel()
	ca, err := NewCA(CAOptions{CommonName: "bootstrap CA", PathLen: 1})
	require.NoError(t, err)
	other, err := NewCA(CAOptions{CommonName: "other CA"})
	require.NoError(t, err)
	inter, err := ca.NewIntermediate(CAOptions{CommonName: "bootstrap intermediate"})
	require.NoError(t, err)
	good := Fingerprint(ca.Certificate())

	tests := []struct {
		name        string
		signer      *CA    // signs the server certificate
		bundle      []byte // what the server serves
		fingerprint string
		host        string
		wantErr     string // "" means accepted
	}{
		{name: "a bundle with the pinned CA that the server chains to is accepted", signer: ca, bundle: ca.BundlePEM(), fingerprint: good, host: "127.0.0.1"},
		{name: "a wrong fingerprint is refused", signer: ca, bundle: ca.BundlePEM(), fingerprint: Fingerprint(other.Certificate()), host: "127.0.0.1", wantErr: "fingerprint"},
		{name: "a server whose certificate does not chain to the pinned bundle is refused", signer: other, bundle: ca.BundlePEM(), fingerprint: good, host: "127.0.0.1", wantErr: "does not chain"},
		{name: "a server certificate for another host is refused", signer: ca, bundle: ca.BundlePEM(), fingerprint: good, host: "127.0.0.2", wantErr: "does not chain"},
		{name: "a bundle with the pinned CA and a second CA that signed the server certificate is refused", signer: other, bundle: append(ca.BundlePEM(), other.BundlePEM()...), fingerprint: good, host: "127.0.0.1", wantErr: "does not chain to the pinned CA"},
		{name: "a bundle with a second CA first and the pinned CA after it is refused when the second CA signed the server certificate", signer: other, bundle: append(other.BundlePEM(), ca.BundlePEM()...), fingerprint: good, host: "127.0.0.1", wantErr: "does not chain to the pinned CA"},
		{name: "a server certificate from an intermediate of the pinned CA that is only in the bundle is accepted", signer: inter, bundle: append(ca.BundlePEM(), inter.CertPEM()...), fingerprint: good, host: "127.0.0.1"},
		{name: "an answer that is not a bundle is refused", signer: ca, bundle: []byte("<html>"), fingerprint: good, host: "127.0.0.1", wantErr: "parse certificates"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			srv := bootstrapServer(t, tc.signer, tc.bundle)
			var b Bootstrap
			body := fetch(t, &b, srv.URL)
			_, err := b.Verify(body, tc.fingerprint, tc.host)
			if tc.wantErr == "" {
				require.NoError(t, err)
				return
			}
			require.ErrorContains(t, err, tc.wantErr)
		})
	}
}

func TestBootstrapWithoutAHandshakeVerifiesNothing(t *testing.T) {
	t.Parallel()
	ca, err := NewCA(CAOptions{CommonName: "bootstrap CA"})
	require.NoError(t, err)
	var b Bootstrap
	_, err = b.Verify(ca.BundlePEM(), Fingerprint(ca.Certificate()), "127.0.0.1")
	require.ErrorContains(t, err, "no server certificate")
}

func TestBootstrapProfileIsTLS13Only(t *testing.T) {
	t.Parallel()
	var b Bootstrap
	c := b.Config()
	require.Equal(t, uint16(tls.VersionTLS13), c.MinVersion)
	require.NotNil(t, c.VerifyConnection)
}

func TestVerifyKeepsOnlyThePinnedCAAndWhatChainsToIt(t *testing.T) {
	t.Parallel()
	ca, err := NewCA(CAOptions{CommonName: "pinned CA", PathLen: 1})
	require.NoError(t, err)
	inter, err := ca.NewIntermediate(CAOptions{CommonName: "pinned intermediate"})
	require.NoError(t, err)
	other, err := NewCA(CAOptions{CommonName: "attacker CA", PathLen: 1})
	require.NoError(t, err)
	otherInter, err := other.NewIntermediate(CAOptions{CommonName: "attacker intermediate"})
	require.NoError(t, err)
	served := append(append(append(other.BundlePEM(), otherInter.CertPEM()...), ca.BundlePEM()...), inter.CertPEM()...)

	srv := bootstrapServer(t, ca, served)
	var b Bootstrap
	body := fetch(t, &b, srv.URL)
	trusted, err := b.Verify(body, Fingerprint(ca.Certificate()), "127.0.0.1")
	require.NoError(t, err)
	certs, err := ParseCertificatesPEM(trusted)
	require.NoError(t, err)
	require.Len(t, certs, 2, "the attacker's root and intermediate are dropped")
	require.True(t, certs[0].Equal(ca.Certificate()), "the pinned CA comes first")
	require.True(t, certs[1].Equal(inter.Certificate()), "the pinned CA's intermediate is kept")
}

func TestPinnedBundleRefusesABundleWithoutThePin(t *testing.T) {
	t.Parallel()
	ca, err := NewCA(CAOptions{CommonName: "pinned CA"})
	require.NoError(t, err)
	other, err := NewCA(CAOptions{CommonName: "attacker CA"})
	require.NoError(t, err)
	_, err = PinnedBundle(other.BundlePEM(), Fingerprint(ca.Certificate()), time.Now())
	require.ErrorIs(t, err, ErrFingerprintMismatch)
}
