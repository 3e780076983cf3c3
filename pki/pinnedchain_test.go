package pki

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"math/big"
	"net"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// rawCert makes a certificate from tmpl signed by parent (self-signed when
// parent is nil), for constraints NewCA does not make.
func rawCert(t *testing.T, tmpl *x509.Certificate, parent *x509.Certificate, parentKey *ecdsa.PrivateKey) (*x509.Certificate, *ecdsa.PrivateKey) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(t, err)
	serial, err := rand.Int(rand.Reader, big.NewInt(1<<62))
	require.NoError(t, err)
	tmpl.SerialNumber = serial
	tmpl.NotBefore, tmpl.NotAfter = time.Now().Add(-time.Hour), time.Now().Add(time.Hour)
	if parent == nil {
		parent, parentKey = tmpl, key
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, parent, &key.PublicKey, parentKey)
	require.NoError(t, err)
	c, err := x509.ParseCertificate(der)
	require.NoError(t, err)
	return c, key
}

func caTmpl(cn string) *x509.Certificate {
	return &x509.Certificate{Subject: pkix.Name{CommonName: cn}, IsCA: true, BasicConstraintsValid: true,
		KeyUsage: x509.KeyUsageCertSign, MaxPathLen: -1}
}

func serverTmpl(name string) *x509.Certificate {
	return &x509.Certificate{Subject: pkix.Name{CommonName: name}, DNSNames: []string{name},
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}
}

// TestAPinnedCAKeepsItsConstraints: a sub-CA kept because it chains to the
// pin must not become a root of its own, which would shed the pin's path
// length and name constraints.
func TestAPinnedCAKeepsItsConstraints(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		root func() *x509.Certificate
	}{
		{"name constraints", func() *x509.Certificate {
			r := caTmpl("pinned, east.example.com only")
			r.PermittedDNSDomainsCritical, r.PermittedDNSDomains = true, []string{"east.example.com"}
			return r
		}},
		{"path length 0", func() *x509.Certificate {
			r := caTmpl("pinned, leaves only")
			r.MaxPathLen, r.MaxPathLenZero = 0, true
			return r
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			root, rootKey := rawCert(t, tc.root(), nil, nil)
			sub, subKey := rawCert(t, caTmpl("sub-CA under the pin"), root, rootKey)
			// The sub-CA itself chains to the pin, so pinning keeps it.
			kept, err := PinnedCAs([]*x509.Certificate{root, sub}, Fingerprint(root), time.Now())
			require.NoError(t, err)
			require.Len(t, kept, 2)
			verify, err := VerifyChainToPinned(kept[0], kept[1:])
			require.NoError(t, err)

			evil, _ := rawCert(t, serverTmpl("broker.evil.example.org"), sub, subKey)
			err = verify(tls.ConnectionState{PeerCertificates: []*x509.Certificate{evil}})
			require.ErrorContains(t, err, "does not chain to the pinned CA")
			// Sending the sub-CA in the handshake changes nothing.
			err = verify(tls.ConnectionState{PeerCertificates: []*x509.Certificate{evil, sub}})
			require.Error(t, err)

			// What the pin allows still passes.
			if tc.name == "name constraints" {
				good, _ := rawCert(t, serverTmpl("broker.east.example.com"), sub, subKey)
				require.NoError(t, verify(tls.ConnectionState{PeerCertificates: []*x509.Certificate{good}}))
			}
			good, _ := rawCert(t, serverTmpl("broker.east.example.com"), root, rootKey)
			require.NoError(t, verify(tls.ConnectionState{PeerCertificates: []*x509.Certificate{good}}))
		})
	}
}

// TestAPinnedChainIsCheckedInTheHandshake: the check refuses the handshake
// that the standard verification (the kept CAs all roots) would accept.
func TestAPinnedChainIsCheckedInTheHandshake(t *testing.T) {
	t.Parallel()
	r := caTmpl("pinned, leaves only")
	r.MaxPathLen, r.MaxPathLenZero = 0, true
	root, rootKey := rawCert(t, r, nil, nil)
	sub, subKey := rawCert(t, caTmpl("sub-CA under the pin"), root, rootKey)
	leafTmpl := serverTmpl("broker")
	leafTmpl.IPAddresses = []net.IP{net.IPv4(127, 0, 0, 1)}
	leaf, leafKey := rawCert(t, leafTmpl, sub, subKey)

	handshake := func(verify func(tls.ConnectionState) error) error {
		roots := x509.NewCertPool()
		roots.AddCert(root)
		roots.AddCert(sub)
		cc := ClientTLSConfig(roots, nil)
		cc.ServerName = "broker"
		cc.VerifyConnection = verify
		sc := &tls.Config{MinVersion: tls.VersionTLS13, Certificates: []tls.Certificate{{Certificate: [][]byte{leaf.Raw, sub.Raw}, PrivateKey: leafKey}}}
		c1, c2 := net.Pipe()
		defer c1.Close()
		defer c2.Close()
		go func() { _ = tls.Server(c2, sc).Handshake() }()
		return tls.Client(c1, cc).Handshake()
	}
	require.NoError(t, handshake(nil), "the kept CAs as roots accept the sub-CA's leaf")
	verify, err := VerifyChainToPinned(root, []*x509.Certificate{sub})
	require.NoError(t, err)
	require.ErrorContains(t, handshake(verify), "does not chain to the pinned CA")
}
