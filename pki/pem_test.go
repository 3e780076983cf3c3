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
	"encoding/pem"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestParseCertificatesPEM(t *testing.T) {
	t.Parallel()
	ca := newTestCA(t)
	leaf := issueServer(t, ca, "broker")
	keyBlock := leaf.KeyPEM
	withHeaders := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Headers: map[string]string{"X": "y"}, Bytes: ca.Certificate().Raw})
	notDER := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: []byte("not DER")})
	many := bytes.Repeat(ca.CertPEM(), MaxCertificates+1)
	huge := append(bytes.Repeat([]byte(" "), MaxCertificatesPEMSize), ca.CertPEM()...)

	tests := []struct {
		name    string
		data    []byte
		want    int
		wantErr string
	}{
		{name: "One certificate parses.", data: ca.CertPEM(), want: 1},
		{name: "A chain parses in order.", data: append(leaf.CertPEM, ca.CertPEM()...), want: 2},
		{name: "Whitespace and CRLF around blocks are allowed.", data: []byte("\r\n  " + strings.ReplaceAll(string(ca.CertPEM()), "\n", "\r\n") + "\n\n"), want: 1},
		{name: "The maximum number of certificates parses.", data: bytes.Repeat(ca.CertPEM(), MaxCertificates), want: MaxCertificates},
		{name: "Empty input is refused.", data: nil, wantErr: "no PEM certificate"},
		{name: "Only whitespace is refused.", data: []byte(" \n"), wantErr: "no PEM certificate"},
		{name: "Text before the first block is refused.", data: append([]byte("subject=CN=x\n"), ca.CertPEM()...), wantErr: "outside PEM blocks"},
		{name: "Trailing garbage is refused.", data: append(ca.CertPEM(), "garbage"...), wantErr: "outside PEM blocks"},
		{name: "A truncated block is refused.", data: ca.CertPEM()[:100], wantErr: "malformed PEM"},
		{name: "A private key block is refused.", data: append(ca.CertPEM(), keyBlock...), wantErr: `unexpected PEM type "PRIVATE KEY"`},
		{name: "A block with headers is refused.", data: withHeaders, wantErr: "headers"},
		{name: "A block that is not a certificate is refused.", data: notDER, wantErr: "block 1"},
		{name: "More certificates than the limit are refused.", data: many, wantErr: "more than 100"},
		{name: "Input larger than the limit is refused before parsing.", data: huge, wantErr: "too large"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			got, err := ParseCertificatesPEM(tt.data)
			if tt.wantErr != "" {
				require.ErrorContains(t, err, tt.wantErr)
				require.Nil(t, got)
				return
			}
			require.NoError(t, err)
			require.Len(t, got, tt.want)
		})
	}
}

func TestParsePrivateKeyPEM(t *testing.T) {
	t.Parallel()
	p256, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(t, err)
	p224, err := ecdsa.GenerateKey(elliptic.P224(), rand.Reader)
	require.NoError(t, err)
	_, ed, err := ed25519.GenerateKey(rand.Reader)
	require.NoError(t, err)
	rsa2048, err := rsa.GenerateKey(rand.Reader, 2048)
	require.NoError(t, err)
	rsa1024, err := rsa.GenerateKey(rand.Reader, 1024)
	require.NoError(t, err)

	pkcs8 := func(k any) []byte {
		der, err := x509.MarshalPKCS8PrivateKey(k)
		require.NoError(t, err)
		return pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: der})
	}
	sec1 := func(k *ecdsa.PrivateKey) []byte {
		der, err := x509.MarshalECPrivateKey(k)
		require.NoError(t, err)
		return pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: der})
	}
	pkcs1 := func(k *rsa.PrivateKey) []byte {
		return pem.EncodeToMemory(&pem.Block{Type: "RSA PRIVATE KEY", Bytes: x509.MarshalPKCS1PrivateKey(k)})
	}
	ecParams := pem.EncodeToMemory(&pem.Block{Type: "EC PARAMETERS", Bytes: []byte{0x06, 0x08, 0x2a, 0x86, 0x48, 0xce, 0x3d, 0x03, 0x01, 0x07}})
	encrypted := pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Headers: map[string]string{"Proc-Type": "4,ENCRYPTED"}, Bytes: []byte{1}})
	ca := newTestCA(t)

	tests := []struct {
		name    string
		data    []byte
		want    crypto.PublicKey
		wantErr string
	}{
		{name: "A PKCS#8 P-256 key parses.", data: pkcs8(p256), want: p256.Public()},
		{name: "A SEC1 P-256 key parses.", data: sec1(p256), want: p256.Public()},
		{name: "A SEC1 key after EC PARAMETERS, as openssl ecparam writes it, parses.", data: append(append([]byte(nil), ecParams...), sec1(p256)...), want: p256.Public()},
		{name: "A PKCS#8 Ed25519 key parses.", data: pkcs8(ed), want: ed.Public()},
		{name: "A PKCS#1 RSA-2048 key parses.", data: pkcs1(rsa2048), want: rsa2048.Public()},
		{name: "A PKCS#8 RSA-2048 key parses.", data: pkcs8(rsa2048), want: rsa2048.Public()},
		{name: "An RSA-1024 key is refused.", data: pkcs1(rsa1024), wantErr: "shorter than 2048"},
		{name: "A P-224 key is refused.", data: sec1(p224), wantErr: "unsupported ECDSA curve"},
		{name: "Empty input is refused.", data: nil, wantErr: "outside PEM blocks"},
		{name: "A certificate block is refused.", data: ca.CertPEM(), wantErr: `unexpected PEM type "CERTIFICATE"`},
		{name: "An encrypted key is refused.", data: encrypted, wantErr: "headers"},
		{name: "Two keys are refused.", data: append(pkcs8(p256), pkcs8(p256)...), wantErr: "after the key block"},
		{name: "Trailing garbage is refused.", data: append(pkcs8(p256), "x"...), wantErr: "after the key block"},
		{name: "EC PARAMETERS alone is refused.", data: ecParams, wantErr: "outside PEM blocks"},
		{name: "EC PARAMETERS before a PKCS#8 key is refused.", data: append(append([]byte(nil), ecParams...), pkcs8(p256)...), wantErr: "must be followed by"},
		{name: "A block with bad DER is refused.", data: pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: []byte("junk")}), wantErr: "parse private key"},
		{name: "Input larger than the limit is refused before parsing.", data: append(bytes.Repeat([]byte("\n"), MaxPrivateKeyPEMSize), pkcs8(p256)...), wantErr: "too large"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			got, err := ParsePrivateKeyPEM(tt.data)
			if tt.wantErr != "" {
				require.ErrorContains(t, err, tt.wantErr)
				require.Nil(t, got)
				return
			}
			require.NoError(t, err)
			require.True(t, got.Public().(interface{ Equal(crypto.PublicKey) bool }).Equal(tt.want))
		})
	}
}

func TestLoadCertPool(t *testing.T) {
	t.Parallel()
	a, b, c := newTestCA(t), newTestCA(t), newTestCA(t)
	dir := t.TempDir()
	bundle := filepath.Join(dir, "bundle.crt")
	require.NoError(t, os.WriteFile(bundle, append(a.CertPEM(), b.CertPEM()...), 0o644))
	pool, err := LoadCertPool(bundle)
	require.NoError(t, err)

	verify := func(ca *CA) error {
		_, err := issueClient(t, ca, "west").Cert.Verify(x509.VerifyOptions{
			Roots: pool, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}, CurrentTime: testNow,
		})
		return err
	}
	require.NoError(t, verify(a), "the first CA in the bundle is trusted")
	require.NoError(t, verify(b), "the second CA in the bundle is trusted")
	require.Error(t, verify(c), "a CA outside the bundle is not trusted")

	_, err = LoadCertPool(filepath.Join(dir, "missing.crt"))
	require.ErrorIs(t, err, os.ErrNotExist)

	bad := filepath.Join(dir, "bad.crt")
	require.NoError(t, os.WriteFile(bad, []byte("not PEM"), 0o644))
	_, err = LoadCertPool(bad)
	require.ErrorContains(t, err, "outside PEM blocks")

	big := filepath.Join(dir, "big.crt")
	require.NoError(t, os.WriteFile(big, bytes.Repeat([]byte("\n"), MaxCertificatesPEMSize+1), 0o644))
	_, err = LoadCertPool(big)
	require.ErrorIs(t, err, ErrPEMTooLarge)
}
