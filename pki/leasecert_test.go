package pki

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"encoding/pem"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

var testLease = LeaseName{
	Namespace:      "team-a",
	ServiceAccount: "deployer",
	ID:             "abcdefghijklmnopqrstuvwxyz",
	UID:            "0f8fad5b-d9cb-469f-a165-70867728950e",
	Peer:           "spiffe://oc.example/cluster/west",
}

func newLeaseTestCA(t *testing.T, now func() time.Time) *CA {
	t.Helper()
	ca, err := NewCA(CAOptions{CommonName: "lease test CA", Now: now})
	require.NoError(t, err)
	return ca
}

func TestLeaseCertificateNamesItsLeaseAndNothingElse(t *testing.T) {
	now := time.Date(2026, 11, 26, 12, 0, 0, 0, time.UTC)
	ca := newLeaseTestCA(t, func() time.Time { return now })
	pub, keyPEM, err := ca.NewLeaseKey()
	require.NoError(t, err)
	require.Contains(t, string(keyPEM), "PRIVATE KEY")
	kp, err := ca.SignLease(pub, testLease, now.Add(time.Hour))
	require.NoError(t, err)
	assert.Equal(t, now.Add(time.Hour), kp.Cert.NotAfter, "the certificate ends with the lease")

	got, err := VerifyLeaseCertificate([]*x509.Certificate{kp.Cert}, ca.CertPool(), now)
	require.NoError(t, err)
	assert.Equal(t, testLease, got)
	assert.True(t, IsLeaseCertificate(kp.Cert))

	// No cluster identity: the API listener and every peer refuse it.
	_, err = IdentityFromCert(kp.Cert)
	require.ErrorIs(t, err, ErrInvalidIdentity)

	// Past the lease, and under another CA, it verifies nowhere.
	_, err = VerifyLeaseCertificate([]*x509.Certificate{kp.Cert}, ca.CertPool(), now.Add(time.Hour+time.Second))
	require.ErrorIs(t, err, ErrInvalidLeaseCertificate)
	other := newLeaseTestCA(t, func() time.Time { return now })
	_, err = VerifyLeaseCertificate([]*x509.Certificate{kp.Cert}, other.CertPool(), now)
	require.ErrorIs(t, err, ErrInvalidLeaseCertificate)
}

func TestAPeerCertificateIsNoLeaseCertificate(t *testing.T) {
	now := time.Date(2026, 11, 26, 12, 0, 0, 0, time.UTC)
	ca := newLeaseTestCA(t, func() time.Time { return now })
	peer, err := ca.IssueClient(ClientOptions{Identity: testLease.Peer, Lifetime: time.Hour})
	require.NoError(t, err)
	_, err = VerifyLeaseCertificate([]*x509.Certificate{peer.Cert}, ca.CertPool(), now)
	require.ErrorIs(t, err, ErrInvalidLeaseCertificate)
	assert.False(t, IsLeaseCertificate(peer.Cert))
}

func TestSignLeaseRefusesWhatItCannotName(t *testing.T) {
	now := time.Date(2026, 11, 26, 12, 0, 0, 0, time.UTC)
	ca := newLeaseTestCA(t, func() time.Time { return now })
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(t, err)
	for name, mutate := range map[string]func(*LeaseName){
		"a namespace with a colon": func(n *LeaseName) { n.Namespace = "a:b" },
		"a short lease id":         func(n *LeaseName) { n.ID = "abc" },
		"an upper-case uid":        func(n *LeaseName) { n.UID = strings.ToUpper(n.UID) },
		"a peer that is no SPIFFE": func(n *LeaseName) { n.Peer = "west" },
		"a service account ':'":    func(n *LeaseName) { n.ServiceAccount = "x:y" },
	} {
		t.Run(name, func(t *testing.T) {
			n := testLease
			mutate(&n)
			_, err := ca.SignLease(key.Public(), n, now.Add(time.Hour))
			require.Error(t, err)
		})
	}
	_, err = ca.SignLease(key.Public(), testLease, now.Add(-time.Second))
	require.Error(t, err, "an expired lease gets no certificate")
	weak, err := ecdsa.GenerateKey(elliptic.P224(), rand.Reader)
	require.NoError(t, err)
	_, err = ca.SignLease(weak.Public(), testLease, now.Add(time.Hour))
	require.ErrorIs(t, err, ErrInvalidCSR)
}

func TestParseLeaseCSRPEMNeedsTheKey(t *testing.T) {
	csrPEM, _, err := NewCSR("spiffe://oc.example/cluster/west", nil)
	require.NoError(t, err)
	csr, err := ParseLeaseCSRPEM(csrPEM)
	require.NoError(t, err)
	require.NotNil(t, csr.PublicKey)
	// A flipped bit in the signature: no proof of possession.
	block, _ := pem.Decode(csrPEM)
	block.Bytes[len(block.Bytes)-1] ^= 1
	_, err = ParseLeaseCSRPEM(pem.EncodeToMemory(block))
	require.ErrorIs(t, err, ErrInvalidCSR)
	require.ErrorContains(t, err, "signature")
}

func FuzzParseLeaseURN(f *testing.F) {
	f.Add(testLease.URN())
	f.Add("urn:tokenbroker:lease:v1:a:b:c:d")
	f.Add("urn:tokenbroker:lease:v1:team-a:deployer:abcdefghijklmnopqrstuvwxyz:0f8fad5b-d9cb-469f-a165-70867728950e:x")
	f.Add("spiffe://oc.example/cluster/west")
	f.Fuzz(func(t *testing.T, s string) {
		n, err := ParseLeaseURN(s)
		if err != nil {
			return
		}
		// One spelling per lease: parsing and building agree.
		if n.URN() != s {
			t.Fatalf("ParseLeaseURN(%q) round-trips to %q", s, n.URN())
		}
	})
}
