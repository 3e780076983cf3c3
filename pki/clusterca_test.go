package pki

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"math/big"
	"net"
	"net/url"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// signedClusterCA has signer sign a cluster CA for id from a fresh key
// and CSR, and returns it as the cluster holds it: a CA that signs at
// testNow.
func signedClusterCA(t *testing.T, signer *CA, id string, lifetime time.Duration) (*KeyPair, *CA) {
	t.Helper()
	csrPEM, keyPEM, err := NewCSR(id, nil)
	require.NoError(t, err)
	csr, csrID, err := ParseCSRPEM(csrPEM)
	require.NoError(t, err)
	require.Equal(t, id, csrID)
	kp, err := signer.SignClusterCA(csr, id, lifetime)
	require.NoError(t, err)
	ca, err := ParseCA(kp.CertPEM, keyPEM, CAOptions{Now: fixedNow})
	require.NoError(t, err)
	return kp, ca
}

// fleetRoot is a root that may sign cluster CAs.
func fleetRoot(t *testing.T) *CA {
	t.Helper()
	root, err := NewCA(CAOptions{CommonName: "fleet root", PathLen: 1, Now: fixedNow})
	require.NoError(t, err)
	return root
}

// leafUnder signs, with ca's key and bypassing its checks, a client
// certificate for the URI id (and DNS names), as a compromised cluster
// could. With isCA it is a CA of no path length, returned as a CA.
func leafUnder(t *testing.T, ca *CA, id string, isCA bool, eku x509.ExtKeyUsage, dnsNames ...string) *x509.Certificate {
	t.Helper()
	return forgedUnder(t, ca, id, isCA, eku, dnsNames...).cert
}

func forgedUnder(t *testing.T, ca *CA, id string, isCA bool, eku x509.ExtKeyUsage, dnsNames ...string) *CA {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(t, err)
	u, err := url.Parse(id)
	require.NoError(t, err)
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(7), Subject: pkix.Name{CommonName: "forged"},
		URIs: []*url.URL{u}, DNSNames: dnsNames,
		NotBefore: testNow.Add(-time.Minute), NotAfter: testNow.Add(time.Hour),
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{eku},
		BasicConstraintsValid: true, IsCA: isCA,
	}
	if isCA {
		tmpl.KeyUsage |= x509.KeyUsageCertSign
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.Certificate(), key.Public(), ca.signer)
	require.NoError(t, err)
	cert, err := x509.ParseCertificate(der)
	require.NoError(t, err)
	return &CA{cert: cert, signer: key}
}

// verifyUnder verifies leaf to root through intermediates for eku at
// testNow.
func verifyUnder(root *CA, leaf *x509.Certificate, eku x509.ExtKeyUsage, intermediates ...*x509.Certificate) error {
	pool := x509.NewCertPool()
	for _, c := range intermediates {
		pool.AddCert(c)
	}
	_, err := leaf.Verify(x509.VerifyOptions{Roots: root.CertPool(), Intermediates: pool, CurrentTime: testNow,
		KeyUsages: []x509.ExtKeyUsage{eku}})
	return err
}

func TestAClusterCASignsPodCertificatesOfItsClusterThatVerifyToTheFleetRoot(t *testing.T) {
	t.Parallel()
	root := fleetRoot(t)
	kp, cluster := signedClusterCA(t, root, eastID, 0)

	c := kp.Cert
	require.True(t, c.IsCA)
	require.True(t, c.BasicConstraintsValid)
	require.Equal(t, 0, c.MaxPathLen)
	require.True(t, c.MaxPathLenZero)
	require.Equal(t, x509.KeyUsageCertSign, c.KeyUsage)
	require.Equal(t, []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}, c.ExtKeyUsage)
	require.Len(t, c.URIs, 1)
	require.Equal(t, eastID, c.URIs[0].String())
	require.Empty(t, c.DNSNames)
	require.Empty(t, c.IPAddresses)
	require.Empty(t, c.EmailAddresses)
	require.Equal(t, []string{"oc.example"}, c.PermittedURIDomains)
	require.Equal(t, []string{".oc.example"}, c.ExcludedURIDomains)
	require.True(t, c.PermittedDNSDomainsCritical, "the name constraints are critical")
	require.Equal(t, testNow.Add(-Backdate), c.NotBefore)
	require.Equal(t, testNow.Add(DefaultClientLifetime), c.NotAfter, "zero lifetime: a client certificate's")
	require.Empty(t, kp.KeyPEM, "the key stays with the cluster")

	id, err := ClusterCAIdentity(c)
	require.NoError(t, err)
	require.Equal(t, eastID, id)

	chain, err := ParseCertificatesPEM(kp.CertPEM)
	require.NoError(t, err)
	require.Len(t, chain, 1, "the cluster CA; the root is the relying party's")
	require.NoError(t, verifyUnder(root, c, x509.ExtKeyUsageClientAuth))

	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(t, err)
	workload, err := WorkloadIdentity(eastID, "argo", "runner")
	require.NoError(t, err)
	nb := testNow.Truncate(time.Second)
	pod, podChainPEM, err := cluster.SignPodCertificate(eastID, PodCertificate{Identity: workload, PublicKey: key.Public(), NotBefore: nb, NotAfter: nb.Add(time.Hour)})
	require.NoError(t, err)
	podChain, err := ParseCertificatesPEM(podChainPEM)
	require.NoError(t, err)
	require.Len(t, podChain, 2, "the pod certificate, then the cluster CA")
	require.Equal(t, c.Raw, podChain[1].Raw)
	require.NoError(t, verifyUnder(root, pod, x509.ExtKeyUsageClientAuth, podChain[1:]...))

	t.Run("Under an intermediate of path length 1, the chain carries the intermediate.", func(t *testing.T) {
		t.Parallel()
		top, err := NewCA(CAOptions{CommonName: "fleet root", PathLen: 2, Now: fixedNow})
		require.NoError(t, err)
		inter, err := top.NewIntermediate(CAOptions{PathLen: 1})
		require.NoError(t, err)
		kp, cluster := signedClusterCA(t, inter, westID, time.Hour)
		chain, err := ParseCertificatesPEM(kp.CertPEM)
		require.NoError(t, err)
		require.Len(t, chain, 2, "the cluster CA, then the intermediate")
		require.Equal(t, inter.Certificate().Raw, chain[1].Raw)
		workload, err := WorkloadIdentity(westID, "argo", "runner")
		require.NoError(t, err)
		pod, podChainPEM, err := cluster.SignPodCertificate(westID, PodCertificate{Identity: workload, PublicKey: key.Public(), NotBefore: nb, NotAfter: nb.Add(30 * time.Minute)})
		require.NoError(t, err)
		podChain, err := ParseCertificatesPEM(podChainPEM)
		require.NoError(t, err)
		require.Len(t, podChain, 3)
		require.NoError(t, verifyUnder(top, pod, x509.ExtKeyUsageClientAuth, podChain[1:]...))
	})
}

func TestAClusterCAsNameConstraintKeepsWhatItSignsInItsTrustDomain(t *testing.T) {
	t.Parallel()
	root := fleetRoot(t)
	kp, cluster := signedClusterCA(t, root, eastID, 0)

	for _, tc := range []struct {
		name string
		id   string
		dns  []string
		eku  x509.ExtKeyUsage
		ok   bool
	}{
		{name: "A workload of its own cluster verifies.", id: eastID + "/ns/argo/sa/runner", eku: x509.ExtKeyUsageClientAuth, ok: true},
		// The constraint bounds the trust domain, not the path: brokers
		// check the cluster (ParseWorkloadIdentity against ClusterCAIdentity).
		{name: "A workload of another cluster of the trust domain verifies: brokers must bound it.", id: westID + "/ns/argo/sa/runner", eku: x509.ExtKeyUsageClientAuth, ok: true},
		{name: "Another trust domain fails the name constraint.", id: "spiffe://other.example/cluster/east/ns/argo/sa/runner", eku: x509.ExtKeyUsageClientAuth},
		{name: "A subdomain of the trust domain fails the name constraint.", id: "spiffe://evil.oc.example/cluster/east", eku: x509.ExtKeyUsageClientAuth},
		{name: "A server certificate fails the extended key usage.", id: eastID + "/ns/argo/sa/runner", eku: x509.ExtKeyUsageServerAuth},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			leaf := leafUnder(t, cluster, tc.id, false, tc.eku, tc.dns...)
			err := verifyUnder(root, leaf, tc.eku, kp.Cert)
			if tc.ok {
				require.NoError(t, err)
				return
			}
			require.Error(t, err)
		})
	}

	t.Run("The name constraint is the x509 package's, not a missing SAN.", func(t *testing.T) {
		t.Parallel()
		leaf := leafUnder(t, cluster, "spiffe://other.example/cluster/east", false, x509.ExtKeyUsageClientAuth)
		var invalid x509.CertificateInvalidError
		require.ErrorAs(t, verifyUnder(root, leaf, x509.ExtKeyUsageClientAuth, kp.Cert), &invalid)
		require.Equal(t, x509.CANotAuthorizedForThisName, invalid.Reason)
	})

	t.Run("No DNS name, IP address or email verifies under it, whatever the key usage asked.", func(t *testing.T) {
		t.Parallel()
		// A verifier that checks only the leaf's extended key usage
		// would take a server certificate a cluster minted for a
		// broker's name: the name constraints refuse it first.
		for _, dns := range []string{"broker.oc.example", "localhost", "invalid.example"} {
			leaf := leafUnder(t, cluster, eastID+"/ns/argo/sa/runner", false, x509.ExtKeyUsageServerAuth, dns)
			var invalid x509.CertificateInvalidError
			require.ErrorAs(t, verifyUnder(root, leaf, x509.ExtKeyUsageAny, kp.Cert), &invalid, dns)
			require.Equal(t, x509.CANotAuthorizedForThisName, invalid.Reason, dns)
		}
		for _, names := range []struct {
			ip    net.IP
			email string
		}{{ip: net.IPv4(127, 0, 0, 1)}, {ip: net.ParseIP("::1")}, {email: "admin@oc.example"}} {
			key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
			require.NoError(t, err)
			tmpl := &x509.Certificate{SerialNumber: big.NewInt(9), NotBefore: testNow.Add(-time.Minute), NotAfter: testNow.Add(time.Hour),
				KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}
			if names.ip != nil {
				tmpl.IPAddresses = []net.IP{names.ip}
			} else {
				tmpl.EmailAddresses = []string{names.email}
			}
			der, err := x509.CreateCertificate(rand.Reader, tmpl, cluster.Certificate(), key.Public(), cluster.signer)
			require.NoError(t, err)
			leaf, err := x509.ParseCertificate(der)
			require.NoError(t, err)
			var invalid x509.CertificateInvalidError
			require.ErrorAs(t, verifyUnder(root, leaf, x509.ExtKeyUsageAny, kp.Cert), &invalid, "%v", names)
			require.Equal(t, x509.CANotAuthorizedForThisName, invalid.Reason, "%v", names)
		}
	})

	t.Run("SignPodCertificate refuses another cluster's workload and a caller naming another cluster.", func(t *testing.T) {
		t.Parallel()
		key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		require.NoError(t, err)
		nb := testNow.Truncate(time.Second)
		west, err := WorkloadIdentity(westID, "argo", "runner")
		require.NoError(t, err)
		_, _, err = cluster.SignPodCertificate(eastID, PodCertificate{Identity: west, PublicKey: key.Public(), NotBefore: nb, NotAfter: nb.Add(time.Hour)})
		require.ErrorIs(t, err, ErrInvalidWorkloadIdentity)
		_, _, err = cluster.SignPodCertificate(westID, PodCertificate{Identity: west, PublicKey: key.Public(), NotBefore: nb, NotAfter: nb.Add(time.Hour)})
		require.ErrorIs(t, err, ErrInvalidWorkloadIdentity)
		require.ErrorContains(t, err, "the cluster CA of "+eastID)
	})
}

func TestAClusterCAMakesNoCA(t *testing.T) {
	t.Parallel()
	root := fleetRoot(t)
	kp, cluster := signedClusterCA(t, root, eastID, 0)

	require.ErrorIs(t, cluster.CheckSignsClusterCAs(), ErrCannotSignCAs)
	csrPEM, _, err := NewCSR(eastID, nil)
	require.NoError(t, err)
	csr, _, err := ParseCSRPEM(csrPEM)
	require.NoError(t, err)
	_, err = cluster.SignClusterCA(csr, eastID, time.Hour)
	require.ErrorIs(t, err, ErrCannotSignCAs)
	_, err = cluster.NewIntermediate(CAOptions{})
	require.Error(t, err)

	// A CA it signs by hand does not verify as a CA: a leaf under it
	// fails.
	sub := forgedUnder(t, cluster, eastID, true, x509.ExtKeyUsageClientAuth)
	leaf := leafUnder(t, sub, eastID+"/ns/argo/sa/runner", false, x509.ExtKeyUsageClientAuth)
	require.NoError(t, verifyUnder(root, leafUnder(t, cluster, eastID+"/ns/argo/sa/runner", false, x509.ExtKeyUsageClientAuth), x509.ExtKeyUsageClientAuth, kp.Cert))
	err = verifyUnder(root, leaf, x509.ExtKeyUsageClientAuth, kp.Cert, sub.cert)
	var invalid x509.CertificateInvalidError
	require.ErrorAs(t, err, &invalid, "a leaf under a CA under a cluster CA")
	require.Equal(t, x509.TooManyIntermediates, invalid.Reason)
}

func TestASigningCAMustAllowAClusterCABelowIt(t *testing.T) {
	t.Parallel()
	csrPEM, _, err := NewCSR(eastID, nil)
	require.NoError(t, err)
	csr, _, err := ParseCSRPEM(csrPEM)
	require.NoError(t, err)

	leafOnly := newTestCA(t)
	_, inter := newTestIntermediate(t)
	top, err := NewCA(CAOptions{PathLen: 1, Now: fixedNow})
	require.NoError(t, err)
	// An intermediate without a path length whose root allows it alone,
	// made as another tool might (NewIntermediate refuses).
	tooDeep := forgedUnder(t, top, eastID, true, x509.ExtKeyUsageClientAuth)
	tooDeep.chain, tooDeep.roots = []*x509.Certificate{tooDeep.cert}, []*x509.Certificate{top.Certificate()}
	for name, ca := range map[string]*CA{
		"a root of path length 0 (pki init)":                         leafOnly,
		"an intermediate of path length 0 (pki init --intermediate)": inter,
		"an unlimited intermediate under a root of path length 1":    tooDeep,
	} {
		err := ca.CheckSignsClusterCAs()
		require.ErrorIs(t, err, ErrCannotSignCAs, name)
		require.ErrorContains(t, err, "pki init --cluster-cas", name)
	}
	_, err = leafOnly.SignClusterCA(csr, eastID, time.Hour)
	require.ErrorIs(t, err, ErrCannotSignCAs)
	require.NoError(t, fleetRoot(t).CheckSignsClusterCAs())
}

func TestAClusterCAIsSignedForTheCSRsIdentityOnlyAndWithinItsSigner(t *testing.T) {
	t.Parallel()
	root := fleetRoot(t)
	csrFor := func(id string) *x509.CertificateRequest {
		csrPEM, _, err := NewCSR(id, nil)
		require.NoError(t, err)
		csr, _, err := ParseCSRPEM(csrPEM)
		require.NoError(t, err)
		return csr
	}
	east := csrFor(eastID)

	_, err := root.SignClusterCA(csrFor(westID), eastID, time.Hour)
	require.ErrorIs(t, err, ErrInvalidCSR, "a CSR for another cluster")
	_, err = root.SignClusterCA(nil, eastID, time.Hour)
	require.ErrorIs(t, err, ErrInvalidCSR)
	_, err = root.SignClusterCA(east, "spiffe://oc.example/east", time.Hour)
	require.ErrorIs(t, err, ErrInvalidIdentity)

	withDNS := *east
	withDNS.DNSNames = []string{"east.example"}
	_, err = root.SignClusterCA(&withDNS, eastID, time.Hour)
	require.ErrorIs(t, err, ErrInvalidCSR, "a CSR with another name")

	kp, err := root.SignClusterCA(east, eastID, 2*time.Hour)
	require.NoError(t, err)
	require.Equal(t, testNow.Add(2*time.Hour), kp.Cert.NotAfter)
	_, err = root.SignClusterCA(east, eastID, -time.Hour)
	require.ErrorContains(t, err, "negative lifetime")
	_, err = root.SignClusterCA(east, eastID, DefaultCALifetime+time.Hour)
	require.ErrorIs(t, err, ErrLifetimeExceedsCA)
}

func TestOnlyAClusterCANamesTheClusterItSignsFor(t *testing.T) {
	t.Parallel()
	root := fleetRoot(t)
	_, inter := newTestIntermediate(t)
	kp, _ := signedClusterCA(t, root, eastID, 0)
	client := issueClient(t, root, "east")

	for name, c := range map[string]*x509.Certificate{
		"a root":                    root.Certificate(),
		"an intermediate of no one": inter.Certificate(),
		"a client certificate":      client.Cert,
		"nothing":                   nil,
	} {
		_, err := ClusterCAIdentity(c)
		require.ErrorIs(t, err, ErrNotClusterCA, name)
	}
	unconstrained := *kp.Cert
	unconstrained.PermittedURIDomains = nil
	_, err := ClusterCAIdentity(&unconstrained)
	require.ErrorIs(t, err, ErrNotClusterCA, "without its name constraint")
	_, err = IdentityFromCert(kp.Cert)
	require.ErrorIs(t, err, ErrInvalidIdentity, "a cluster CA is never a client certificate")
}

func TestNothingButAPodCertificateIsTakenFromUnderAClusterCA(t *testing.T) {
	t.Parallel()
	root := fleetRoot(t)
	kp, cluster := signedClusterCA(t, root, eastID, 0)

	// A cluster identity under a cluster CA verifies under X.509 (the
	// name constraint bounds the trust domain only) and is refused.
	forged := leafUnder(t, cluster, westID, false, x509.ExtKeyUsageClientAuth)
	inter := x509.NewCertPool()
	inter.AddCert(kp.Cert)
	chains, err := forged.Verify(x509.VerifyOptions{Roots: root.CertPool(), Intermediates: inter, CurrentTime: testNow,
		KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}})
	require.NoError(t, err)
	require.ErrorIs(t, CheckNoClusterCA(chains), ErrCertificateUnderClusterCA)

	// A client certificate of the fleet CA itself is not.
	client := issueClient(t, root, "west")
	chains, err = client.Cert.Verify(x509.VerifyOptions{Roots: root.CertPool(), CurrentTime: testNow,
		KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}})
	require.NoError(t, err)
	require.NoError(t, CheckNoClusterCA(chains))
	require.NoError(t, CheckNoClusterCA(nil))

	// A lease certificate (a URN, no host) under a cluster CA fails the
	// name constraint: a cluster cannot mint gateway leases.
	lease := leafUnder(t, cluster, leaseURNPrefix+"x", false, x509.ExtKeyUsageClientAuth)
	_, err = VerifyLeaseCertificate([]*x509.Certificate{lease, kp.Cert}, root.CertPool(), testNow)
	require.ErrorIs(t, err, ErrInvalidLeaseCertificate)
	require.ErrorContains(t, err, "cannot be matched against constraints")
}
