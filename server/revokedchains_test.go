package server

import (
	"crypto/tls"
	"crypto/x509"
	"net/http"
	"slices"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/tokenbroker/tokenbroker/broker/audit"
	"github.com/tokenbroker/tokenbroker/pki"
)

func TestADeniedCertificateInAnyVerifiedChainRefusesTheCaller(t *testing.T) {
	t.Parallel()
	other, err := pki.NewCA(pki.CAOptions{CommonName: "cross CA", PathLen: 1})
	require.NoError(t, err)
	inter, err := other.NewIntermediate(pki.CAOptions{CommonName: "cross intermediate"})
	require.NoError(t, err)
	serial := func(c *x509.Certificate) string { return c.SerialNumber.Text(16) }

	tests := []struct {
		name     string
		revoked  func(h *harness) string // the serial on the deny list
		wantCode int
	}{
		{name: "a revoked intermediate in the second chain refuses the caller", revoked: func(*harness) string { return serial(inter.Certificate()) }, wantCode: http.StatusUnauthorized},
		{name: "a revoked CA at the end of the second chain refuses the caller", revoked: func(*harness) string { return serial(other.Certificate()) }, wantCode: http.StatusUnauthorized},
		{name: "a revoked CA of the first chain refuses the caller", revoked: func(h *harness) string { return serial(h.pki.ca.Certificate()) }, wantCode: http.StatusUnauthorized},
		{name: "a caller with nothing revoked in any chain is served", revoked: func(*harness) string { return "ffff" }, wantCode: http.StatusOK},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			var deny string
			b := &fakeBroker{revoked: func(_ string, serials ...string) bool { return slices.Contains(serials, deny) }}
			h := newHarness(t, b)
			deny = tc.revoked(h)
			leaf := h.pki.client.Cert
			state := &tls.ConnectionState{
				Version:           tls.VersionTLS13,
				HandshakeComplete: true,
				PeerCertificates:  []*x509.Certificate{leaf},
				VerifiedChains: [][]*x509.Certificate{
					{leaf, h.pki.ca.Certificate()},
					{leaf, inter.Certificate(), other.Certificate()},
				},
			}
			rec := h.do(request{method: http.MethodGet, path: "/v1/whoami", tls: state})
			require.Equal(t, tc.wantCode, rec.Code, rec.Body.String())
			if tc.wantCode == http.StatusUnauthorized {
				refused := b.refused()
				require.Len(t, refused, 1)
				require.Equal(t, audit.RefusedRevoked, refused[0].code)
			}
		})
	}
}
