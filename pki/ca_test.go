package pki

import (
	"bytes"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/x509"
	"encoding/pem"
	"io"
	"io/fs"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestNewCA(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name         string
		opts         CAOptions
		wantCN       string
		wantLifetime time.Duration
		wantErr      string
	}{
		{
			name:         "The zero options make a five-year CA with the default name.",
			opts:         CAOptions{Now: fixedNow},
			wantCN:       DefaultCACommonName,
			wantLifetime: DefaultCALifetime,
		},
		{
			name:         "The common name and lifetime are taken from the options.",
			opts:         CAOptions{CommonName: "east CA", Lifetime: 48 * time.Hour, Now: fixedNow},
			wantCN:       "east CA",
			wantLifetime: 48 * time.Hour,
		},
		{
			name:    "A negative lifetime is refused.",
			opts:    CAOptions{Lifetime: -time.Hour, Now: fixedNow},
			wantErr: "negative lifetime",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			ca, err := NewCA(tt.opts)
			if tt.wantErr != "" {
				require.ErrorContains(t, err, tt.wantErr)
				return
			}
			require.NoError(t, err)
			c := ca.Certificate()
			require.Equal(t, tt.wantCN, c.Subject.CommonName)
			require.True(t, c.BasicConstraintsValid)
			require.True(t, c.IsCA)
			require.Equal(t, 0, c.MaxPathLen)
			require.True(t, c.MaxPathLenZero)
			require.Equal(t, x509.KeyUsageCertSign|x509.KeyUsageCRLSign, c.KeyUsage)
			require.Empty(t, c.ExtKeyUsage)
			require.Equal(t, testNow.Add(-Backdate), c.NotBefore)
			require.Equal(t, testNow.Add(tt.wantLifetime), c.NotAfter)
			require.NotEmpty(t, c.SubjectKeyId)
			require.NoError(t, c.CheckSignatureFrom(c), "the CA is self-signed")
			pub, ok := c.PublicKey.(*ecdsa.PublicKey)
			require.True(t, ok)
			require.Equal(t, elliptic.P256(), pub.Curve)
			require.Equal(t, x509.ECDSAWithSHA256, c.SignatureAlgorithm)
		})
	}
}

func TestCAKeyPEMIsPKCS8AndMatchesTheCertificate(t *testing.T) {
	t.Parallel()
	ca := newTestCA(t)
	keyPEM, err := ca.KeyPEM()
	require.NoError(t, err)
	block, rest := pem.Decode(keyPEM)
	require.NotNil(t, block)
	require.Empty(t, rest)
	require.Equal(t, "PRIVATE KEY", block.Type)
	key, err := x509.ParsePKCS8PrivateKey(block.Bytes)
	require.NoError(t, err)
	require.True(t, key.(*ecdsa.PrivateKey).PublicKey.Equal(ca.Certificate().PublicKey))

	certs, err := ParseCertificatesPEM(ca.CertPEM())
	require.NoError(t, err)
	require.Len(t, certs, 1)
	require.Equal(t, ca.Certificate().Raw, certs[0].Raw)
}

func TestIssueServer(t *testing.T) {
	t.Parallel()
	ca := newTestCA(t)
	tests := []struct {
		name         string
		opts         ServerOptions
		wantCN       string
		wantLifetime time.Duration
		wantErr      string
		wantErrIs    error
	}{
		{
			name:         "DNS names become SANs and the first one the common name, valid for 90 days by default.",
			opts:         ServerOptions{DNSNames: []string{"broker.east.example", "*.east.example"}},
			wantCN:       "broker.east.example",
			wantLifetime: DefaultServerLifetime,
		},
		{
			name:         "IP addresses alone are enough and the lifetime is taken from the options.",
			opts:         ServerOptions{IPAddresses: []net.IP{net.ParseIP("127.0.0.1"), net.ParseIP("::1")}, Lifetime: time.Hour},
			wantCN:       "127.0.0.1",
			wantLifetime: time.Hour,
		},
		{
			name:    "A certificate without any name is refused.",
			opts:    ServerOptions{},
			wantErr: "at least one DNS name or IP address",
		},
		{
			name:    "An upper-case DNS name is refused.",
			opts:    ServerOptions{DNSNames: []string{"Broker.example"}},
			wantErr: "invalid DNS name",
		},
		{
			name:    "A DNS name with an empty label is refused.",
			opts:    ServerOptions{DNSNames: []string{"broker..example"}},
			wantErr: "invalid DNS name",
		},
		{
			name:    "A malformed IP address is refused.",
			opts:    ServerOptions{IPAddresses: []net.IP{{1, 2, 3}}},
			wantErr: "invalid IP address",
		},
		{
			name:    "A negative lifetime is refused.",
			opts:    ServerOptions{DNSNames: []string{"broker"}, Lifetime: -time.Second},
			wantErr: "negative lifetime",
		},
		{
			name:      "A certificate that would outlive the CA is refused, not shortened.",
			opts:      ServerOptions{DNSNames: []string{"broker"}, Lifetime: DefaultCALifetime + time.Second},
			wantErrIs: ErrLifetimeExceedsCA,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			kp, err := ca.IssueServer(tt.opts)
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
			c := kp.Cert
			require.Equal(t, tt.wantCN, c.Subject.CommonName)
			require.Equal(t, tt.opts.DNSNames, c.DNSNames)
			require.Len(t, c.IPAddresses, len(tt.opts.IPAddresses))
			for i, ip := range tt.opts.IPAddresses {
				require.True(t, ip.Equal(c.IPAddresses[i]))
			}
			require.Empty(t, c.URIs)
			require.Equal(t, []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}, c.ExtKeyUsage)
			requireLeaf(t, ca, kp, tt.wantLifetime)
		})
	}
}

func TestIssueClient(t *testing.T) {
	t.Parallel()
	ca := newTestCA(t)
	tests := []struct {
		name         string
		opts         ClientOptions
		wantLifetime time.Duration
		wantErr      string
	}{
		{
			name:         "The identity is the only URI SAN and the common name, valid for 24 hours by default.",
			opts:         ClientOptions{Identity: "spiffe://oc.example/cluster/west"},
			wantLifetime: DefaultClientLifetime,
		},
		{
			name:         "The lifetime is taken from the options.",
			opts:         ClientOptions{Identity: "spiffe://oc.example/cluster/west", Lifetime: 30 * 24 * time.Hour},
			wantLifetime: 30 * 24 * time.Hour,
		},
		{
			name:    "An empty identity is refused.",
			opts:    ClientOptions{},
			wantErr: "invalid cluster identity",
		},
		{
			name:    "An identity outside the cluster path is refused.",
			opts:    ClientOptions{Identity: "spiffe://oc.example/ns/default/sa/default"},
			wantErr: "invalid cluster identity",
		},
		{
			name:    "A certificate that would outlive the CA is refused.",
			opts:    ClientOptions{Identity: "spiffe://oc.example/cluster/west", Lifetime: 10 * DefaultCALifetime},
			wantErr: ErrLifetimeExceedsCA.Error(),
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			kp, err := ca.IssueClient(tt.opts)
			if tt.wantErr != "" {
				require.ErrorContains(t, err, tt.wantErr)
				require.Nil(t, kp)
				return
			}
			require.NoError(t, err)
			c := kp.Cert
			require.Equal(t, tt.opts.Identity, c.Subject.CommonName)
			require.Len(t, c.URIs, 1)
			require.Equal(t, tt.opts.Identity, c.URIs[0].String())
			require.Empty(t, c.DNSNames)
			require.Empty(t, c.IPAddresses)
			require.Equal(t, []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}, c.ExtKeyUsage)
			id, err := IdentityFromCert(c)
			require.NoError(t, err)
			require.Equal(t, tt.opts.Identity, id)
			requireLeaf(t, ca, kp, tt.wantLifetime)
		})
	}
}

// requireLeaf checks what every issued leaf shares.
func requireLeaf(t *testing.T, ca *CA, kp *KeyPair, lifetime time.Duration) {
	t.Helper()
	c := kp.Cert
	require.True(t, c.BasicConstraintsValid)
	require.False(t, c.IsCA)
	require.Equal(t, x509.KeyUsageDigitalSignature, c.KeyUsage)
	require.Equal(t, testNow.Add(-Backdate), c.NotBefore, "NotBefore is backdated")
	require.Equal(t, testNow.Add(lifetime), c.NotAfter)
	require.Equal(t, ca.Certificate().Subject.String(), c.Issuer.String())
	require.Equal(t, ca.Certificate().SubjectKeyId, c.AuthorityKeyId)
	require.NoError(t, c.CheckSignatureFrom(ca.Certificate()))
	pub, ok := c.PublicKey.(*ecdsa.PublicKey)
	require.True(t, ok)
	require.Equal(t, elliptic.P256(), pub.Curve)
	require.Positive(t, c.SerialNumber.Sign())
	require.LessOrEqual(t, c.SerialNumber.BitLen(), 128)

	tc, err := kp.TLSCertificate()
	require.NoError(t, err, "the key matches the certificate")
	require.Equal(t, c.Raw, tc.Leaf.Raw)
	block, _ := pem.Decode(kp.KeyPEM)
	require.Equal(t, "PRIVATE KEY", block.Type)
}

func TestSerialNumbers(t *testing.T) {
	t.Parallel()
	t.Run("Serials are positive, at most 128 bits and all different.", func(t *testing.T) {
		t.Parallel()
		ca := newTestCA(t)
		seen := map[string]bool{ca.Certificate().SerialNumber.String(): true}
		long := 0
		for range 64 {
			kp := issueServer(t, ca, "broker")
			s := kp.Cert.SerialNumber
			require.Positive(t, s.Sign())
			require.LessOrEqual(t, s.BitLen(), 128)
			if s.BitLen() > 64 {
				long++
			}
			require.False(t, seen[s.String()], "serial %s repeated", s)
			seen[s.String()] = true
		}
		// A 128-bit uniform serial is longer than 64 bits except with
		// probability 2^-64 per draw.
		require.Equal(t, 64, long)
	})
	t.Run("Serials come from the injected randomness.", func(t *testing.T) {
		t.Parallel()
		ca, err := NewCA(CAOptions{Now: fixedNow, Rand: constReader(0xff)})
		require.NoError(t, err)
		want := new(big.Int).Sub(new(big.Int).Lsh(big.NewInt(1), 128), big.NewInt(1))
		require.Equal(t, want, ca.Certificate().SerialNumber)
		kp := issueServer(t, ca, "broker")
		require.Equal(t, want, kp.Cert.SerialNumber)
	})
	t.Run("A randomness source that only gives zeros is an error, not serial zero.", func(t *testing.T) {
		t.Parallel()
		_, err := NewCA(CAOptions{Now: fixedNow, Rand: constReader(0)})
		require.ErrorContains(t, err, "serial number")
	})
	t.Run("A failing randomness source is an error.", func(t *testing.T) {
		t.Parallel()
		_, err := NewCA(CAOptions{Now: fixedNow, Rand: errReader{}})
		require.ErrorIs(t, err, io.ErrUnexpectedEOF)
	})
}

type constReader byte

func (r constReader) Read(p []byte) (int, error) {
	for i := range p {
		p[i] = byte(r)
	}
	return len(p), nil
}

type errReader struct{}

func (errReader) Read([]byte) (int, error) { return 0, io.ErrUnexpectedEOF }

func TestChainVerification(t *testing.T) {
	t.Parallel()
	ca := newTestCA(t)
	other := newTestCA(t)
	server, err := ca.IssueServer(ServerOptions{DNSNames: []string{"broker.example"}, IPAddresses: []net.IP{net.ParseIP("127.0.0.1")}})
	require.NoError(t, err)
	client := issueClient(t, ca, "west")
	foreign := issueClient(t, other, "west")
	at := testNow.Add(time.Hour)

	tests := []struct {
		name    string
		cert    *x509.Certificate
		roots   *x509.CertPool
		usage   x509.ExtKeyUsage
		dnsName string
		at      time.Time
		wantErr bool
	}{
		{name: "A server certificate verifies for server authentication.", cert: server.Cert, roots: ca.CertPool(), usage: x509.ExtKeyUsageServerAuth, dnsName: "broker.example", at: at},
		{name: "A server certificate verifies for its IP address.", cert: server.Cert, roots: ca.CertPool(), usage: x509.ExtKeyUsageServerAuth, dnsName: "127.0.0.1", at: at},
		{name: "A server certificate does not verify for another name.", cert: server.Cert, roots: ca.CertPool(), usage: x509.ExtKeyUsageServerAuth, dnsName: "evil.example", at: at, wantErr: true},
		{name: "A server certificate does not verify for client authentication.", cert: server.Cert, roots: ca.CertPool(), usage: x509.ExtKeyUsageClientAuth, at: at, wantErr: true},
		{name: "A client certificate verifies for client authentication.", cert: client.Cert, roots: ca.CertPool(), usage: x509.ExtKeyUsageClientAuth, at: at},
		{name: "A client certificate does not verify for server authentication.", cert: client.Cert, roots: ca.CertPool(), usage: x509.ExtKeyUsageServerAuth, at: at, wantErr: true},
		{name: "A client certificate verifies inside the backdated window.", cert: client.Cert, roots: ca.CertPool(), usage: x509.ExtKeyUsageClientAuth, at: testNow.Add(-Backdate / 2)},
		{name: "A client certificate does not verify after it expires.", cert: client.Cert, roots: ca.CertPool(), usage: x509.ExtKeyUsageClientAuth, at: testNow.Add(DefaultClientLifetime + time.Second), wantErr: true},
		{name: "A certificate from another CA does not verify.", cert: foreign.Cert, roots: ca.CertPool(), usage: x509.ExtKeyUsageClientAuth, at: at, wantErr: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			_, err := tt.cert.Verify(x509.VerifyOptions{
				Roots:       tt.roots,
				KeyUsages:   []x509.ExtKeyUsage{tt.usage},
				DNSName:     tt.dnsName,
				CurrentTime: tt.at,
			})
			if tt.wantErr {
				require.Error(t, err)
				return
			}
			require.NoError(t, err)
		})
	}
}

func TestIssuingFromAnExpiredCAFails(t *testing.T) {
	t.Parallel()
	clock := newFakeClock(testNow)
	ca, err := NewCA(CAOptions{Lifetime: time.Hour, Now: clock.Now})
	require.NoError(t, err)
	clock.Add(2 * time.Hour)
	_, err = ca.IssueClient(ClientOptions{Identity: "spiffe://oc.example/cluster/west"})
	require.ErrorContains(t, err, "CA expired")
}

func TestCAFiles(t *testing.T) {
	t.Parallel()
	t.Run("Written files have the right modes and load back into a working CA.", func(t *testing.T) {
		t.Parallel()
		dir := t.TempDir()
		ca := newTestCA(t)
		certFile, keyFile := filepath.Join(dir, "ca.crt"), filepath.Join(dir, "ca.key")
		require.NoError(t, ca.WriteFiles(certFile, keyFile))
		require.Equal(t, os.FileMode(0o644), fileMode(t, certFile))
		require.Equal(t, os.FileMode(0o600), fileMode(t, keyFile))
		entries, err := os.ReadDir(dir)
		require.NoError(t, err)
		require.Len(t, entries, 2, "no temporary files are left behind")

		loaded, err := LoadCAWithOptions(certFile, keyFile, CAOptions{Now: fixedNow})
		require.NoError(t, err)
		require.Equal(t, ca.Certificate().Raw, loaded.Certificate().Raw)
		kp := issueClient(t, loaded, "west")
		_, err = kp.Cert.Verify(x509.VerifyOptions{Roots: ca.CertPool(), KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}, CurrentTime: testNow})
		require.NoError(t, err)

		_, err = LoadCA(certFile, keyFile)
		require.NoError(t, err)
	})
	t.Run("Existing files are not overwritten unless replacing is asked for.", func(t *testing.T) {
		t.Parallel()
		dir := t.TempDir()
		first, second := newTestCA(t), newTestCA(t)
		certFile, keyFile := filepath.Join(dir, "ca.crt"), filepath.Join(dir, "ca.key")
		require.NoError(t, first.WriteFiles(certFile, keyFile))
		err := second.WriteFiles(certFile, keyFile)
		require.ErrorIs(t, err, fs.ErrExist)
		data, err := os.ReadFile(certFile)
		require.NoError(t, err)
		require.Equal(t, first.CertPEM(), data)

		require.NoError(t, second.ReplaceFiles(certFile, keyFile))
		data, err = os.ReadFile(certFile)
		require.NoError(t, err)
		require.Equal(t, second.CertPEM(), data)
		require.Equal(t, os.FileMode(0o600), fileMode(t, keyFile))
	})
	t.Run("An existing key file alone blocks writing and leaves no certificate behind.", func(t *testing.T) {
		t.Parallel()
		dir := t.TempDir()
		certFile, keyFile := filepath.Join(dir, "ca.crt"), filepath.Join(dir, "ca.key")
		require.NoError(t, os.WriteFile(keyFile, []byte("operator's key"), 0o600))
		require.ErrorIs(t, newTestCA(t).WriteFiles(certFile, keyFile), fs.ErrExist)
		_, err := os.Stat(certFile)
		require.ErrorIs(t, err, fs.ErrNotExist)
	})
	t.Run("A key pair overwrites with WriteFiles and refuses with CreateFiles.", func(t *testing.T) {
		t.Parallel()
		dir := t.TempDir()
		ca := newTestCA(t)
		certFile, keyFile := filepath.Join(dir, "tls.crt"), filepath.Join(dir, "tls.key")
		require.NoError(t, issueServer(t, ca, "a").CreateFiles(certFile, keyFile))
		require.Equal(t, os.FileMode(0o600), fileMode(t, keyFile))
		require.Equal(t, os.FileMode(0o644), fileMode(t, certFile))
		require.ErrorIs(t, issueServer(t, ca, "b").CreateFiles(certFile, keyFile), fs.ErrExist)
		kp := issueServer(t, ca, "c")
		require.NoError(t, kp.WriteFiles(certFile, keyFile))
		data, err := os.ReadFile(keyFile)
		require.NoError(t, err)
		require.Equal(t, kp.KeyPEM, data)
		require.Equal(t, os.FileMode(0o600), fileMode(t, keyFile))
	})
	t.Run("The same name for certificate and key is refused.", func(t *testing.T) {
		t.Parallel()
		f := filepath.Join(t.TempDir(), "both.pem")
		require.ErrorContains(t, newTestCA(t).WriteFiles(f, f), "same file")
	})
}

func TestParseCA(t *testing.T) {
	t.Parallel()
	ca := newTestCA(t)
	other := newTestCA(t)
	caKey, err := ca.KeyPEM()
	require.NoError(t, err)
	otherKey, err := other.KeyPEM()
	require.NoError(t, err)
	leaf := issueServer(t, ca, "broker")
	ecKey, err := x509.MarshalECPrivateKey(ca.signer.(*ecdsa.PrivateKey))
	require.NoError(t, err)
	sec1 := pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: ecKey})

	tests := []struct {
		name    string
		cert    []byte
		key     []byte
		wantErr string
	}{
		{name: "A CA with its PKCS#8 key loads.", cert: ca.CertPEM(), key: caKey},
		{name: "A CA with its SEC1 key, as openssl writes it, loads.", cert: ca.CertPEM(), key: sec1},
		{name: "A CA with another CA's key is refused.", cert: ca.CertPEM(), key: otherKey, wantErr: "does not match"},
		{name: "A leaf certificate is refused as a CA.", cert: leaf.CertPEM, key: leaf.KeyPEM, wantErr: "not a CA"},
		{name: "Two unrelated CA certificates are refused as a chain.", cert: append(ca.CertPEM(), other.CertPEM()...), key: caKey, wantErr: "not signed by certificate 2"},
		{name: "A missing key is refused.", cert: ca.CertPEM(), key: nil, wantErr: "parse CA key"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			got, err := ParseCA(tt.cert, tt.key, CAOptions{Now: fixedNow})
			if tt.wantErr != "" {
				require.ErrorContains(t, err, tt.wantErr)
				return
			}
			require.NoError(t, err)
			require.Equal(t, ca.Certificate().Raw, got.Certificate().Raw)
			kp := issueClient(t, got, "west")
			require.NoError(t, kp.Cert.CheckSignatureFrom(ca.Certificate()))
		})
	}
}

func TestLoadCAReportsMissingFiles(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	_, err := LoadCA(filepath.Join(dir, "ca.crt"), filepath.Join(dir, "ca.key"))
	require.ErrorIs(t, err, fs.ErrNotExist)
}

func TestKeyMaterialIsNotInCertificatePEM(t *testing.T) {
	t.Parallel()
	ca := newTestCA(t)
	kp := issueClient(t, ca, "west")
	for _, b := range [][]byte{ca.CertPEM(), kp.CertPEM} {
		require.False(t, bytes.Contains(b, []byte("PRIVATE")))
	}
	require.True(t, strings.HasPrefix(string(kp.KeyPEM), "-----BEGIN PRIVATE KEY-----"))
}
