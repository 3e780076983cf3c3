package pki

import (
	"crypto/tls"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"testing"

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
	ca, err := NewCA(CAOptions{CommonName: "bootstrap CA"})
	require.NoError(t, err)
	other, err := NewCA(CAOptions{CommonName: "other CA"})
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
		{name: "an answer that is not a bundle is refused", signer: ca, bundle: []byte("<html>"), fingerprint: good, host: "127.0.0.1", wantErr: "parse certificates"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			srv := bootstrapServer(t, tc.signer, tc.bundle)
			var b Bootstrap
			body := fetch(t, &b, srv.URL)
			err := b.Verify(body, tc.fingerprint, tc.host)
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
	require.ErrorContains(t, b.Verify(ca.BundlePEM(), Fingerprint(ca.Certificate()), "127.0.0.1"), "no server certificate")
}

func TestBootstrapProfileIsTLS13Only(t *testing.T) {
	t.Parallel()
	var b Bootstrap
	c := b.Config()
	require.Equal(t, uint16(tls.VersionTLS13), c.MinVersion)
	require.NotNil(t, c.VerifyConnection)
}
