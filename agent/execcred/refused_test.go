package execcred

import (
	"context"
	"crypto/tls"
	"net"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/tokenbroker/tokenbroker/agent/client"
	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/pki"
)

// refusedInHandshake returns the error of a real request to a TLS server
// with the broker's profile that refuses the client's certificate in the
// handshake: it trusts another CA for its clients.
func refusedInHandshake(t *testing.T) error {
	t.Helper()
	brokerCA, err := pki.NewCA(pki.CAOptions{CommonName: "broker CA"})
	require.NoError(t, err)
	otherCA, err := pki.NewCA(pki.CAOptions{CommonName: "another client CA"})
	require.NoError(t, err)
	srvKP, err := brokerCA.IssueServer(pki.ServerOptions{IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1)}, Lifetime: time.Hour})
	require.NoError(t, err)
	srvCert, err := tls.X509KeyPair(srvKP.CertPEM, srvKP.KeyPEM)
	require.NoError(t, err)
	srv := httptest.NewUnstartedServer(http.NotFoundHandler())
	srv.TLS = &tls.Config{MinVersion: tls.VersionTLS13, ClientAuth: tls.RequireAndVerifyClientCert,
		ClientCAs: otherCA.CertPool(), Certificates: []tls.Certificate{srvCert}}
	srv.StartTLS()
	defer srv.Close()

	kp, err := brokerCA.IssueClient(pki.ClientOptions{Identity: testKey.Identity, Lifetime: time.Hour})
	require.NoError(t, err)
	cert, err := tls.X509KeyPair(kp.CertPEM, kp.KeyPEM)
	require.NoError(t, err)
	c, err := client.New(client.Config{URL: srv.URL, RootCAs: brokerCA.CertPool(), Timeout: 10 * time.Second,
		GetClientCertificate: func(*tls.CertificateRequestInfo) (*tls.Certificate, error) { return &cert, nil }})
	require.NoError(t, err)
	defer c.CloseIdleConnections()
	_, err = c.Kubeconfig(context.Background(), apiv1.KubeconfigRequest{})
	require.Error(t, err)
	return err
}
