package pki

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"crypto/x509/pkix"
	"net"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestParseUserCSRPEMAcceptsOnlyACommonName(t *testing.T) {
	t.Parallel()
	ec, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(t, err)
	weak, err := rsa.GenerateKey(rand.Reader, 1024)
	require.NoError(t, err)
	tests := []struct {
		name string
		tmpl x509.CertificateRequest
		key  crypto.Signer
		want string // "" means accepted
	}{
		{"A common name alone is a user.", x509.CertificateRequest{Subject: pkix.Name{CommonName: "tokenbroker:west:ab"}}, ec, ""},
		{"An organization would be a group.", x509.CertificateRequest{Subject: pkix.Name{CommonName: "u", Organization: []string{"system:masters"}}}, ec, "single common name"},
		{"Any other subject attribute is refused too.", x509.CertificateRequest{Subject: pkix.Name{CommonName: "u", Country: []string{"DE"}}}, ec, "single common name"},
		{"No common name is no user.", x509.CertificateRequest{Subject: pkix.Name{Organization: []string{"x"}}}, ec, "single common name"},
		{"A DNS SAN is refused.", x509.CertificateRequest{Subject: pkix.Name{CommonName: "u"}, DNSNames: []string{"a.example"}}, ec, "SANs"},
		{"An IP SAN is refused.", x509.CertificateRequest{Subject: pkix.Name{CommonName: "u"}, IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1)}}, ec, "SANs"},
		{"A weak RSA key is refused.", x509.CertificateRequest{Subject: pkix.Name{CommonName: "u"}}, weak, "shorter than"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			data := csrPEM(t, &tc.tmpl, tc.key)
			csr, cn, err := ParseUserCSRPEM(data)
			if tc.want == "" {
				require.NoError(t, err)
				require.Equal(t, tc.tmpl.Subject.CommonName, cn)
				require.NotNil(t, csr)
				return
			}
			require.ErrorIs(t, err, ErrInvalidCSR)
			require.ErrorContains(t, err, tc.want)
		})
	}
}

func TestNewUserCSRNamesTheUserAfterItsOwnKey(t *testing.T) {
	t.Parallel()
	var seen crypto.PublicKey
	csrPEM, keyPEM, name, err := NewUserCSR(func(pub crypto.PublicKey) (string, error) {
		seen = pub
		return "user-of-this-key", nil
	}, nil)
	require.NoError(t, err)
	require.Equal(t, "user-of-this-key", name)
	csr, cn, err := ParseUserCSRPEM(csrPEM)
	require.NoError(t, err)
	require.Equal(t, name, cn)
	require.True(t, csr.PublicKey.(*ecdsa.PublicKey).Equal(seen), "the name function saw the CSR's key")
	require.Contains(t, string(keyPEM), "PRIVATE KEY")
}
