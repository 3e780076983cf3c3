package client

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"net"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/pki"
)

// refusingBroker is a real TLS server with the broker's profile whose
// client CA is clientCA, and the pool that verifies its certificate.
func refusingBroker(t *testing.T, clientCA *x509.CertPool, verify func(tls.ConnectionState) error) (*httptest.Server, *x509.CertPool) {
	t.Helper()
	ca, err := pki.NewCA(pki.CAOptions{CommonName: "broker CA"})
	require.NoError(t, err)
	kp, err := ca.IssueServer(pki.ServerOptions{IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1)}, Lifetime: time.Hour})
	require.NoError(t, err)
	cert, err := tls.X509KeyPair(kp.CertPEM, kp.KeyPEM)
	require.NoError(t, err)
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		w.WriteHeader(http.StatusCreated)
		_, _ = w.Write([]byte(`{}`))
	}))
	srv.TLS = &tls.Config{
		MinVersion:       tls.VersionTLS13,
		ClientAuth:       tls.RequireAndVerifyClientCert,
		ClientCAs:        clientCA,
		Certificates:     []tls.Certificate{cert},
		VerifyConnection: verify,
	}
	srv.StartTLS()
	t.Cleanup(srv.Close)
	return srv, ca.CertPool()
}

func TestAClientCertificateTheBrokerRefusesInTheHandshakeIsARefusal(t *testing.T) {
	t.Parallel()
	ours, err := pki.NewCA(pki.CAOptions{CommonName: "our CA"})
	require.NoError(t, err)
	other, err := pki.NewCA(pki.CAOptions{CommonName: "another CA"})
	require.NoError(t, err)
	kp, err := ours.IssueClient(pki.ClientOptions{Identity: "spiffe://oc.example/cluster/west", Lifetime: time.Hour})
	require.NoError(t, err)
	mine, err := tls.X509KeyPair(kp.CertPEM, kp.KeyPEM)
	require.NoError(t, err)
	revoked := func(tls.ConnectionState) error {
		return &tls.CertificateVerificationError{Err: x509.ErrUnsupportedAlgorithm}
	}
	tests := []struct {
		name     string
		clientCA *x509.CertPool
		verify   func(tls.ConnectionState) error
		cert     *tls.Certificate
		refused  bool
	}{
		{name: "A client certificate of a CA the broker does not trust is refused.", clientCA: other.CertPool(), cert: &mine, refused: true},
		{name: "A client certificate the broker's own check refuses (revoked) is refused.", clientCA: ours.CertPool(), verify: revoked, cert: &mine, refused: true},
		{name: "No client certificate at all is refused.", clientCA: ours.CertPool(), cert: &tls.Certificate{}, refused: true},
		{name: "An accepted client certificate is no refusal.", clientCA: ours.CertPool(), cert: &mine},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			srv, roots := refusingBroker(t, tt.clientCA, tt.verify)
			c, err := New(Config{URL: srv.URL, RootCAs: roots, Timeout: 10 * time.Second,
				GetClientCertificate: func(*tls.CertificateRequestInfo) (*tls.Certificate, error) { return tt.cert, nil }})
			require.NoError(t, err)
			defer c.CloseIdleConnections()
			_, err = c.Kubeconfig(context.Background(), apiv1.KubeconfigRequest{})
			if !tt.refused {
				require.NoError(t, err)
				return
			}
			t.Logf("as it surfaces: %v", err)
			require.ErrorIs(t, err, ErrCertificateRefused)
			require.False(t, Retryable(err), "asking again will not help")
		})
	}
}

func TestABrokerWhoseCertificateIsNotVerifiedCannotRefuseTheClient(t *testing.T) {
	t.Parallel()
	// Only a broker that proved its certificate can refuse ours: anyone on
	// the path can send a plaintext alert before that. Here the client
	// does not trust the server's certificate, so its handshake fails and
	// the error is no refusal.
	ours, err := pki.NewCA(pki.CAOptions{CommonName: "our CA"})
	require.NoError(t, err)
	srv, _ := refusingBroker(t, ours.CertPool(), nil)
	c, err := New(Config{URL: srv.URL, RootCAs: ours.CertPool(), Timeout: 10 * time.Second})
	require.NoError(t, err)
	defer c.CloseIdleConnections()
	_, err = c.Kubeconfig(context.Background(), apiv1.KubeconfigRequest{})
	require.Error(t, err)
	require.NotErrorIs(t, err, ErrCertificateRefused)
}
