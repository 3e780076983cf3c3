package pki

import (
	"bytes"
	"crypto"
	"crypto/ecdsa"
	"crypto/ed25519"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/asn1"
	"encoding/pem"
	"math/big"
	"net"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func mustURL(t *testing.T, s string) *url.URL {
	t.Helper()
	u, err := url.Parse(s)
	require.NoError(t, err)
	return u
}

// csrPEM makes a PEM CSR from tmpl signed by key (a new P-256 key if nil).
func csrPEM(t *testing.T, tmpl *x509.CertificateRequest, key crypto.Signer) []byte {
	t.Helper()
	if key == nil {
		var err error
		key, err = ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		require.NoError(t, err)
	}
	der, err := x509.CreateCertificateRequest(rand.Reader, tmpl, key)
	require.NoError(t, err)
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE REQUEST", Bytes: der})
}

func identityCSR(t *testing.T, key crypto.Signer) []byte {
	t.Helper()
	return csrPEM(t, &x509.CertificateRequest{URIs: []*url.URL{mustURL(t, testIdentity)}}, key)
}

func TestParseCSRPEM(t *testing.T) {
	t.Parallel()
	p384, err := ecdsa.GenerateKey(elliptic.P384(), rand.Reader)
	require.NoError(t, err)
	p521, err := ecdsa.GenerateKey(elliptic.P521(), rand.Reader)
	require.NoError(t, err)
	_, edKey, err := ed25519.GenerateKey(rand.Reader)
	require.NoError(t, err)
	rsa2048, err := rsa.GenerateKey(rand.Reader, 2048)
	require.NoError(t, err)
	rsa1024, err := rsa.GenerateKey(rand.Reader, 1024)
	require.NoError(t, err)

	valid := identityCSR(t, nil)
	block, _ := pem.Decode(valid)
	badSig := append([]byte(nil), block.Bytes...)
	badSig[len(badSig)-3] ^= 0x01
	other := csrPEM(t, &x509.CertificateRequest{URIs: []*url.URL{mustURL(t, "spiffe://oc.example/cluster/east")}}, nil)

	tests := []struct {
		name    string
		data    []byte
		wantErr string
	}{
		{name: "A P-256 CSR with the identity as its only URI SAN is accepted.", data: valid},
		{name: "A P-384 CSR is accepted.", data: identityCSR(t, p384)},
		{name: "An Ed25519 CSR is accepted.", data: identityCSR(t, edKey)},
		{name: "An RSA-2048 CSR is accepted.", data: identityCSR(t, rsa2048)},
		{name: "A CSR with surrounding whitespace and CRLF line ends is accepted.", data: append([]byte("\r\n  "), bytes.ReplaceAll(valid, []byte("\n"), []byte("\r\n"))...)},
		{name: "A CSR with a subject and extra extensions is accepted (they are ignored when signing).", data: csrPEM(t, &x509.CertificateRequest{
			Subject: pkix.Name{CommonName: "admin", Organization: []string{"system:masters"}},
			URIs:    []*url.URL{mustURL(t, testIdentity)},
		}, nil)},
		{name: "A CSR with a bad signature is refused.", data: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE REQUEST", Bytes: badSig}), wantErr: "signature"},
		{name: "A CSR with two URI SANs is refused.", data: csrPEM(t, &x509.CertificateRequest{URIs: []*url.URL{mustURL(t, testIdentity), mustURL(t, "spiffe://oc.example/cluster/east")}}, nil), wantErr: "2 URI SANs"},
		{name: "A CSR without a URI SAN is refused.", data: csrPEM(t, &x509.CertificateRequest{Subject: pkix.Name{CommonName: testIdentity}}, nil), wantErr: "0 URI SANs"},
		{name: "A CSR whose URI SAN is not a cluster identity is refused.", data: csrPEM(t, &x509.CertificateRequest{URIs: []*url.URL{mustURL(t, "https://oc.example/cluster/west")}}, nil), wantErr: "invalid cluster identity"},
		{name: "A CSR with a DNS SAN is refused.", data: csrPEM(t, &x509.CertificateRequest{URIs: []*url.URL{mustURL(t, testIdentity)}, DNSNames: []string{"kubernetes.default"}}, nil), wantErr: "DNS, IP or email SANs"},
		{name: "A CSR with an IP SAN is refused.", data: csrPEM(t, &x509.CertificateRequest{URIs: []*url.URL{mustURL(t, testIdentity)}, IPAddresses: []net.IP{net.ParseIP("10.0.0.1")}}, nil), wantErr: "DNS, IP or email SANs"},
		{name: "A CSR with an email SAN is refused.", data: csrPEM(t, &x509.CertificateRequest{URIs: []*url.URL{mustURL(t, testIdentity)}, EmailAddresses: []string{"a@b.example"}}, nil), wantErr: "DNS, IP or email SANs"},
		{name: "A CSR with a weak RSA-1024 key is refused.", data: identityCSR(t, rsa1024), wantErr: "1024 bits is shorter than 2048"},
		{name: "A CSR with a P-521 key is refused.", data: identityCSR(t, p521), wantErr: "unsupported ECDSA curve"},
		{name: "A CSR followed by garbage is refused.", data: append(append([]byte(nil), valid...), "garbage"...), wantErr: "unexpected data after"},
		{name: "Garbage before a CSR is refused.", data: append([]byte("garbage\n"), valid...), wantErr: "outside PEM blocks"},
		{name: "Two CSR blocks are refused.", data: append(append([]byte(nil), valid...), other...), wantErr: "unexpected data after"},
		{name: "A block of the wrong type is refused.", data: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: block.Bytes}), wantErr: `unexpected PEM type "CERTIFICATE"`},
		{name: "The legacy NEW CERTIFICATE REQUEST type is refused.", data: pem.EncodeToMemory(&pem.Block{Type: "NEW CERTIFICATE REQUEST", Bytes: block.Bytes}), wantErr: "unexpected PEM type"},
		{name: "A block with headers is refused.", data: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE REQUEST", Headers: map[string]string{"Proc-Type": "4,ENCRYPTED"}, Bytes: block.Bytes}), wantErr: "headers"},
		{name: "A block that is not DER is refused.", data: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE REQUEST", Bytes: []byte("nope")}), wantErr: "asn1"},
		{name: "An oversized input is refused before it is decoded.", data: append(append([]byte(nil), valid...), bytes.Repeat([]byte(" "), MaxCSRPEMSize)...), wantErr: "limit 16384"},
		{name: "Empty input is refused.", data: []byte(" \n"), wantErr: "no PEM certificate request"},
		{name: "Nil input is refused.", data: nil, wantErr: "no PEM certificate request"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			csr, id, err := ParseCSRPEM(tt.data)
			if tt.wantErr != "" {
				require.ErrorIs(t, err, ErrInvalidCSR)
				require.ErrorContains(t, err, tt.wantErr)
				require.Nil(t, csr)
				require.Empty(t, id)
				return
			}
			require.NoError(t, err)
			require.Equal(t, testIdentity, id)
			require.NoError(t, csr.CheckSignature())
		})
	}
}

func TestNewCSR(t *testing.T) {
	t.Parallel()
	t.Run("NewCSR makes a CSR that ParseCSRPEM accepts and a matching PKCS#8 key.", func(t *testing.T) {
		t.Parallel()
		csrPEM, keyPEM, err := NewCSR(testIdentity, nil)
		require.NoError(t, err)
		csr, id, err := ParseCSRPEM(csrPEM)
		require.NoError(t, err)
		require.Equal(t, testIdentity, id)
		require.Equal(t, testIdentity, csr.Subject.CommonName)
		key, err := ParsePrivateKeyPEM(keyPEM)
		require.NoError(t, err)
		require.True(t, key.Public().(*ecdsa.PublicKey).Equal(csr.PublicKey))
		require.True(t, strings.HasPrefix(string(keyPEM), "-----BEGIN PRIVATE KEY-----"))

		// The signed certificate and the key make a working pair.
		ca := newTestCA(t)
		kp, err := ca.SignClient(csr, id, 0)
		require.NoError(t, err)
		kp.KeyPEM = keyPEM
		_, err = kp.TLSCertificate()
		require.NoError(t, err)
	})
	t.Run("NewCSR refuses an identity that is not a cluster identity.", func(t *testing.T) {
		t.Parallel()
		_, _, err := NewCSR("spiffe://oc.example/West", nil)
		require.ErrorIs(t, err, ErrInvalidIdentity)
	})
}

// oidBasicConstraints is id-ce-basicConstraints.
var oidBasicConstraints = asn1.ObjectIdentifier{2, 5, 29, 19}

func TestSignClient(t *testing.T) {
	t.Parallel()
	ca := newTestCA(t)
	caBC, err := asn1.Marshal(struct {
		IsCA       bool `asn1:"optional"`
		MaxPathLen int  `asn1:"optional,default:-1"`
	}{IsCA: true, MaxPathLen: 5})
	require.NoError(t, err)
	greedyPEM := csrPEM(t, &x509.CertificateRequest{
		Subject:        pkix.Name{CommonName: "system:admin", Organization: []string{"system:masters"}},
		DNSNames:       []string{"kubernetes.default.svc", "*.example"},
		IPAddresses:    []net.IP{net.ParseIP("10.0.0.1")},
		EmailAddresses: []string{"root@example"},
		URIs:           []*url.URL{mustURL(t, "spiffe://oc.example/cluster/east"), mustURL(t, "https://evil.example")},
		ExtraExtensions: []pkix.Extension{
			{Id: oidBasicConstraints, Critical: true, Value: caBC},
		},
	}, nil)
	block, _ := pem.Decode(greedyPEM)
	greedy, err := x509.ParseCertificateRequest(block.Bytes)
	require.NoError(t, err)
	require.NoError(t, greedy.CheckSignature())
	_, _, err = ParseCSRPEM(greedyPEM)
	require.Error(t, err, "ParseCSRPEM refuses this CSR; SignClient must be safe even when called with it")

	plain, _, err := ParseCSRPEM(identityCSR(t, nil))
	require.NoError(t, err)
	rsa1024, err := rsa.GenerateKey(rand.Reader, 1024)
	require.NoError(t, err)
	weakBlock, _ := pem.Decode(identityCSR(t, rsa1024))
	weak, err := x509.ParseCertificateRequest(weakBlock.Bytes)
	require.NoError(t, err)
	forged := *plain
	forged.Signature = append([]byte(nil), plain.Signature...)
	forged.Signature[8] ^= 0xff

	tests := []struct {
		name         string
		csr          *x509.CertificateRequest
		identity     string
		lifetime     time.Duration
		wantLifetime time.Duration
		wantErr      string
		wantErrIs    error
	}{
		{name: "A certificate is signed for the CSR's key, valid for 24 hours by default.", csr: plain, identity: testIdentity, wantLifetime: DefaultClientLifetime},
		{name: "The lifetime is taken from the argument.", csr: plain, identity: testIdentity, lifetime: time.Hour, wantLifetime: time.Hour},
		{name: "Everything the CSR asks for beyond its key is ignored: SANs, subject, CA basic constraints.", csr: greedy, identity: testIdentity, wantLifetime: DefaultClientLifetime},
		{name: "A certificate that would outlive the CA is refused.", csr: plain, identity: testIdentity, lifetime: DefaultCALifetime + time.Hour, wantErrIs: ErrLifetimeExceedsCA},
		{name: "A negative lifetime is refused.", csr: plain, identity: testIdentity, lifetime: -time.Hour, wantErr: "negative lifetime"},
		{name: "An identity that is not a cluster identity is refused.", csr: plain, identity: "spiffe://oc.example/cluster/", wantErrIs: ErrInvalidIdentity},
		{name: "A nil CSR is refused.", csr: nil, identity: testIdentity, wantErrIs: ErrInvalidCSR},
		{name: "A CSR whose signature does not verify is refused.", csr: &forged, identity: testIdentity, wantErrIs: ErrInvalidCSR},
		{name: "A CSR with a weak key is refused.", csr: weak, identity: testIdentity, wantErrIs: ErrInvalidCSR},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			kp, err := ca.SignClient(tt.csr, tt.identity, tt.lifetime)
			if tt.wantErr != "" || tt.wantErrIs != nil {
				require.Error(t, err)
				require.Nil(t, kp)
				if tt.wantErr != "" {
					require.ErrorContains(t, err, tt.wantErr)
				}
				if tt.wantErrIs != nil {
					require.ErrorIs(t, err, tt.wantErrIs)
				}
				return
			}
			require.NoError(t, err)
			require.Empty(t, kp.KeyPEM, "the key stays with the requester")
			c := kp.Cert
			require.True(t, c.PublicKey.(*ecdsa.PublicKey).Equal(tt.csr.PublicKey))
			require.Equal(t, pkix.Name{CommonName: tt.identity}.String(), c.Subject.String())
			require.Len(t, c.URIs, 1)
			require.Equal(t, tt.identity, c.URIs[0].String())
			require.Empty(t, c.DNSNames)
			require.Empty(t, c.IPAddresses)
			require.Empty(t, c.EmailAddresses)
			require.False(t, c.IsCA)
			require.True(t, c.BasicConstraintsValid)
			require.Equal(t, x509.KeyUsageDigitalSignature, c.KeyUsage)
			require.Equal(t, []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}, c.ExtKeyUsage)
			require.Equal(t, testNow.Add(-Backdate), c.NotBefore)
			require.Equal(t, testNow.Add(tt.wantLifetime), c.NotAfter)
			require.LessOrEqual(t, c.SerialNumber.BitLen(), 128)
			// Exactly the extensions this package sets: key usage, extended
			// key usage, basic constraints, SAN, authority key ID.
			var ids []string
			for _, e := range c.Extensions {
				ids = append(ids, e.Id.String())
			}
			require.ElementsMatch(t, []string{"2.5.29.15", "2.5.29.37", "2.5.29.19", "2.5.29.17", "2.5.29.35"}, ids)
			id, err := IdentityFromCert(c)
			require.NoError(t, err)
			require.Equal(t, tt.identity, id)
			_, err = c.Verify(x509.VerifyOptions{Roots: ca.CertPool(), KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}, CurrentTime: testNow})
			require.NoError(t, err)
			certs, err := ParseCertificatesPEM(kp.CertPEM)
			require.NoError(t, err)
			require.Len(t, certs, 1, "a root CA adds no chain")
		})
	}
}

func TestCheckPublicKeyBoundsRSA(t *testing.T) {
	t.Parallel()
	bits := func(n uint) *rsa.PublicKey {
		return &rsa.PublicKey{N: new(big.Int).Lsh(big.NewInt(1), n-1), E: 65537}
	}
	tests := []struct {
		name    string
		key     crypto.PublicKey
		wantErr string
	}{
		{name: "An RSA key of 8192 bits is accepted.", key: bits(8192)},
		{name: "An RSA key of 8193 bits is refused before any signature is checked with it.", key: bits(8193), wantErr: "longer than 8192"},
		{name: "An RSA key of 2047 bits is refused.", key: bits(2047), wantErr: "shorter than 2048"},
		{name: "A DSA-like unknown key type is refused.", key: struct{}{}, wantErr: "unsupported public key type"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			err := checkPublicKey(tt.key)
			if tt.wantErr == "" {
				require.NoError(t, err)
				return
			}
			require.ErrorContains(t, err, tt.wantErr)
		})
	}
}
