package agent

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/tokenbroker/tokenbroker/agent/config"
	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/pki"
)

// certBroker answers a client-certificate request as a broker does to a
// caller that sent its own CSR: a kubeconfig with the certificate and no
// key. It records the request.
type certBroker struct {
	got apiv1.KubeconfigRequest
}

func (b *certBroker) WhoAmI(context.Context) (*apiv1.WhoAmI, error) {
	return &apiv1.WhoAmI{Identity: "spiffe://oc.example/cluster/west", Peer: "west"}, nil
}

func (b *certBroker) Kubeconfig(_ context.Context, req apiv1.KubeconfigRequest) (*apiv1.KubeconfigResponse, error) {
	b.got = req
	kc := fmt.Sprintf(`apiVersion: v1
kind: Config
clusters:
- name: east
  cluster: {server: "https://east.example.com:6443", certificate-authority-data: %s}
users:
- name: u@east
  user: {client-certificate-data: %s}
contexts:
- name: argo/u@east
  context: {cluster: east, user: u@east, namespace: argo}
current-context: argo/u@east
`, b64(testCA), b64("-----BEGIN CERTIFICATE-----\nMAA=\n-----END CERTIFICATE-----\n"))
	return &apiv1.KubeconfigResponse{LeaseID: leaseID(1), Kubeconfig: kc, Credential: apiv1.CredentialClientCertificate,
		ExpiresAt: time.Now().Add(time.Hour), GrantedTTL: "1h0m0s"}, nil
}

// For a client certificate the agent makes the key, sends only a CSR for
// the user the broker expects (peer name and key fingerprint), and puts its
// key into the kubeconfig it hands to the outputs.
func TestACertificateKeyIsMadeHereAndNeverSent(t *testing.T) {
	t.Parallel()
	b := &certBroker{}
	cred, err := Fetch(context.Background(), b, config.RequestConfig{Namespace: "argo", Credential: apiv1.CredentialClientCertificate, TTL: "1h"}, time.Now)
	require.NoError(t, err)

	require.Equal(t, apiv1.CredentialClientCertificate, b.got.Credential)
	require.Empty(t, b.got.ServiceAccount)
	csr, cn, err := pki.ParseUserCSRPEM([]byte(b.got.CSR))
	require.NoError(t, err)
	want, err := apiv1.CertificateUser("west", csr.PublicKey)
	require.NoError(t, err)
	require.Equal(t, want, cn)
	require.NotContains(t, b.got.CSR, "PRIVATE KEY")

	require.Equal(t, apiv1.CredentialClientCertificate, cred.Kind())
	require.True(t, strings.HasPrefix(string(cred.KeyData), "-----BEGIN PRIVATE KEY-----"), "the kubeconfig got the agent's key")
	require.NotEmpty(t, cred.CertData)
}
