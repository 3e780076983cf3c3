package pki

import (
	"crypto/x509"
	"crypto/x509/pkix"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func verifyLeaf(t *testing.T, leaf *x509.Certificate, roots *x509.CertPool, inter []*x509.Certificate, usage x509.ExtKeyUsage) error {
	t.Helper()
	ip := x509.NewCertPool()
	for _, c := range inter {
		ip.AddCert(c)
	}
	_, err := leaf.Verify(x509.VerifyOptions{Roots: roots, Intermediates: ip, KeyUsages: []x509.ExtKeyUsage{usage}, CurrentTime: testNow})
	return err
}

func TestIntermediateCA(t *testing.T) {
	t.Parallel()
	root, inter := newTestIntermediate(t)

	t.Run("The root allows one intermediate and the intermediate signs leaves only.", func(t *testing.T) {
		t.Parallel()
		r := root.Certificate()
		require.True(t, r.IsCA)
		require.Equal(t, 1, r.MaxPathLen)
		require.False(t, r.MaxPathLenZero)
		require.Empty(t, root.Chain())
		require.Equal(t, root.CertPEM(), root.BundlePEM())

		i := inter.Certificate()
		require.True(t, i.IsCA)
		require.True(t, i.BasicConstraintsValid)
		require.Equal(t, 0, i.MaxPathLen)
		require.True(t, i.MaxPathLenZero)
		require.Equal(t, x509.KeyUsageCertSign|x509.KeyUsageCRLSign, i.KeyUsage)
		require.Equal(t, "test intermediate", i.Subject.CommonName)
		require.Equal(t, r.Subject.String(), i.Issuer.String())
		require.Equal(t, r.SubjectKeyId, i.AuthorityKeyId)
		require.NoError(t, i.CheckSignatureFrom(r))
		require.Equal(t, testNow.Add(-Backdate), i.NotBefore)
		require.Equal(t, r.NotAfter, i.NotAfter, "by default the intermediate expires with the root")
		require.Positive(t, i.SerialNumber.Sign())
		require.LessOrEqual(t, i.SerialNumber.BitLen(), 128)
		require.NotEqual(t, r.PublicKey, i.PublicKey)

		require.Equal(t, []*x509.Certificate{i}, inter.Chain())
		require.Equal(t, encodeCert(i.Raw), inter.CertPEM())
		require.Equal(t, root.CertPEM(), inter.BundlePEM(), "peers trust the root")
	})

	t.Run("Leaves issued by the intermediate carry the chain and verify to the root alone.", func(t *testing.T) {
		t.Parallel()
		server := issueServer(t, inter, "broker.example")
		client := issueClient(t, inter, "west")
		csr, _, err := NewCSR(testIdentity, nil)
		require.NoError(t, err)
		req, id, err := ParseCSRPEM(csr)
		require.NoError(t, err)
		signed, err := inter.SignClient(req, id, 0)
		require.NoError(t, err)
		for _, tc := range []struct {
			kp    *KeyPair
			usage x509.ExtKeyUsage
		}{{server, x509.ExtKeyUsageServerAuth}, {client, x509.ExtKeyUsageClientAuth}, {signed, x509.ExtKeyUsageClientAuth}} {
			certs, err := ParseCertificatesPEM(tc.kp.CertPEM)
			require.NoError(t, err)
			require.Len(t, certs, 2, "leaf and intermediate")
			require.Equal(t, tc.kp.Cert.Raw, certs[0].Raw)
			require.Equal(t, inter.Certificate().Raw, certs[1].Raw)
			require.NoError(t, verifyLeaf(t, certs[0], root.CertPool(), certs[1:], tc.usage))
			require.NoError(t, verifyLeaf(t, certs[0], inter.CertPool(), certs[1:], tc.usage), "the intermediate's pool is the root")
			require.Error(t, verifyLeaf(t, certs[0], root.CertPool(), nil, tc.usage), "without the chain the root alone is not enough")
		}
		tc, err := client.TLSCertificate()
		require.NoError(t, err)
		require.Len(t, tc.Certificate, 2, "TLS sends the whole chain")
	})

	t.Run("An intermediate cannot make another CA.", func(t *testing.T) {
		t.Parallel()
		_, err := inter.NewIntermediate(CAOptions{})
		require.ErrorContains(t, err, "path length does not allow intermediates")
	})

	t.Run("A CA certificate signed by the intermediate anyway does not verify, nor do its leaves.", func(t *testing.T) {
		t.Parallel()
		key, err := newKey(inter.rand)
		require.NoError(t, err)
		rogue, err := createCert(inter.rand, caTemplate("rogue", 0, testNow, testNow.Add(time.Hour)), inter.Certificate(), key.Public(), inter.signer)
		require.NoError(t, err)
		rogueCA := &CA{cert: rogue, chain: []*x509.Certificate{rogue, inter.Certificate()}, roots: root.roots, signer: key, now: fixedNow, rand: inter.rand}
		leaf, err := rogueCA.IssueClient(ClientOptions{Identity: testIdentity, Lifetime: 30 * time.Minute})
		require.NoError(t, err)
		certs, err := ParseCertificatesPEM(leaf.CertPEM)
		require.NoError(t, err)
		require.Len(t, certs, 3)
		err = verifyLeaf(t, certs[0], root.CertPool(), certs[1:], x509.ExtKeyUsageClientAuth)
		require.Error(t, err)
		var invalid x509.CertificateInvalidError
		require.ErrorAs(t, err, &invalid)
		require.Equal(t, x509.TooManyIntermediates, invalid.Reason)
	})

	t.Run("A root made with the default path length cannot make an intermediate.", func(t *testing.T) {
		t.Parallel()
		_, err := newTestCA(t).NewIntermediate(CAOptions{})
		require.ErrorContains(t, err, "path length does not allow intermediates")
	})

	t.Run("An intermediate outliving its root is refused, a shorter one is fine.", func(t *testing.T) {
		t.Parallel()
		_, err := root.NewIntermediate(CAOptions{Lifetime: DefaultCALifetime + time.Hour})
		require.ErrorIs(t, err, ErrLifetimeExceedsCA)
		short, err := root.NewIntermediate(CAOptions{Lifetime: 48 * time.Hour})
		require.NoError(t, err)
		require.Equal(t, testNow.Add(48*time.Hour), short.Certificate().NotAfter)
		require.Equal(t, DefaultCACommonName+" intermediate", short.Certificate().Subject.CommonName)
		_, err = short.IssueClient(ClientOptions{Identity: testIdentity, Lifetime: 72 * time.Hour})
		require.ErrorIs(t, err, ErrLifetimeExceedsCA, "leaves are bounded by the intermediate, not the root")
	})

	t.Run("Invalid intermediate options are refused.", func(t *testing.T) {
		t.Parallel()
		_, err := root.NewIntermediate(CAOptions{PathLen: 1})
		require.ErrorContains(t, err, "path length 0 at most", "a root of path length 1 has intermediates that sign leaves only")
		_, err = root.NewIntermediate(CAOptions{PathLen: -1})
		require.ErrorContains(t, err, "negative path length")
		_, err = root.NewIntermediate(CAOptions{Lifetime: -time.Hour})
		require.ErrorContains(t, err, "negative lifetime")
		_, err = NewCA(CAOptions{PathLen: -1})
		require.ErrorContains(t, err, "negative path length")
	})
}

func TestLoadIntermediateCA(t *testing.T) {
	t.Parallel()
	root, inter := newTestIntermediate(t)
	other, otherInter := newTestIntermediate(t)
	interKey, err := inter.KeyPEM()
	require.NoError(t, err)
	dir := t.TempDir()
	write := func(name string, data []byte) string {
		f := filepath.Join(dir, name)
		require.NoError(t, os.WriteFile(f, data, 0o600))
		return f
	}
	keyFile := write("ca.key", interKey)
	interOnly := write("inter.crt", inter.CertPEM())
	interAndRoot := write("inter-root.crt", append(inter.CertPEM(), root.CertPEM()...))
	rootThenInter := write("root-inter.crt", append(root.CertPEM(), inter.CertPEM()...))
	interOtherRoot := write("inter-other.crt", append(inter.CertPEM(), other.CertPEM()...))
	bundle := write("bundle.crt", root.CertPEM())
	rotationBundle := write("rotation.crt", append(other.CertPEM(), root.CertPEM()...))
	otherBundle := write("other-bundle.crt", append(other.CertPEM(), otherInter.CertPEM()...))

	tests := []struct {
		name      string
		certFile  string
		bundle    string
		wantRoots bool
		wantErr   string
	}{
		{name: "The intermediate alone loads; its root is unknown.", certFile: interOnly},
		{name: "The intermediate followed by its root loads with the root as anchor.", certFile: interAndRoot, wantRoots: true},
		{name: "The intermediate alone with the bundle loads with the root as anchor.", certFile: interOnly, bundle: bundle, wantRoots: true},
		{name: "A rotation bundle with another root as well finds the right root.", certFile: interOnly, bundle: rotationBundle, wantRoots: true},
		{name: "The intermediate and its root with the bundle loads.", certFile: interAndRoot, bundle: bundle, wantRoots: true},
		{name: "A bundle the intermediate does not chain to is refused.", certFile: interOnly, bundle: otherBundle, wantErr: "does not chain to any certificate of the trust bundle"},
		{name: "The chain in the wrong order is refused.", certFile: rootThenInter, wantErr: "not signed by certificate 2"},
		{name: "The intermediate followed by another root is refused.", certFile: interOtherRoot, wantErr: "not signed by certificate 2"},
		{name: "A missing bundle file is refused.", certFile: interOnly, bundle: filepath.Join(dir, "missing.crt"), wantErr: "no such file"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			ca, err := LoadCAChain(tt.certFile, keyFile, tt.bundle, CAOptions{Now: fixedNow})
			if tt.wantErr != "" {
				require.ErrorContains(t, err, tt.wantErr)
				return
			}
			require.NoError(t, err)
			require.Equal(t, inter.Certificate().Raw, ca.Certificate().Raw)
			require.Len(t, ca.Chain(), 1)
			require.Equal(t, inter.Certificate().Raw, ca.Chain()[0].Raw)
			require.Equal(t, inter.CertPEM(), ca.CertPEM(), "the certificate file is the chain without the root")
			if tt.wantRoots {
				require.Equal(t, root.CertPEM(), ca.BundlePEM())
			} else {
				require.Equal(t, inter.CertPEM(), ca.BundlePEM(), "without the root the topmost CA stands in")
			}
			kp := issueClient(t, ca, "west")
			certs, err := ParseCertificatesPEM(kp.CertPEM)
			require.NoError(t, err)
			require.NoError(t, verifyLeaf(t, certs[0], root.CertPool(), certs[1:], x509.ExtKeyUsageClientAuth))
			require.NoError(t, verifyLeaf(t, certs[0], ca.CertPool(), certs[1:], x509.ExtKeyUsageClientAuth))
		})
	}

	t.Run("LoadCA reads an intermediate written by WriteFiles.", func(t *testing.T) {
		t.Parallel()
		d := t.TempDir()
		certFile, keyFile := filepath.Join(d, "ca.crt"), filepath.Join(d, "ca.key")
		require.NoError(t, inter.WriteFiles(certFile, keyFile))
		ca, err := LoadCA(certFile, keyFile)
		require.NoError(t, err)
		require.Equal(t, inter.Certificate().Raw, ca.Certificate().Raw)
	})
	t.Run("A chain certificate that is not a CA is refused.", func(t *testing.T) {
		t.Parallel()
		leaf := issueServer(t, inter, "broker")
		_, err := ParseCA(append(inter.CertPEM(), encodeCert(leaf.Cert.Raw)...), interKey, CAOptions{})
		require.ErrorContains(t, err, "certificate 2 is not a CA")
	})
	t.Run("A chain certificate without the certificate-signing key usage is refused.", func(t *testing.T) {
		t.Parallel()
		tmpl := caTemplate("no sign", 0, testNow, testNow.Add(time.Hour))
		tmpl.KeyUsage = x509.KeyUsageDigitalSignature
		tmpl.Subject = pkix.Name{CommonName: "no sign"}
		c, err := createCert(root.rand, tmpl, nil, root.signer.Public(), root.signer)
		require.NoError(t, err)
		rootKey, err := root.KeyPEM()
		require.NoError(t, err)
		_, err = ParseCA(encodeCert(c.Raw), rootKey, CAOptions{})
		require.ErrorContains(t, err, "key usage does not allow signing certificates")
	})
}

func TestTLSServesTheIntermediateChain(t *testing.T) {
	t.Parallel()
	// Real time: the handshake checks validity with the system clock.
	root, err := NewCA(CAOptions{CommonName: "chain root", PathLen: 1})
	require.NoError(t, err)
	inter, err := root.NewIntermediate(CAOptions{CommonName: "chain intermediate"})
	require.NoError(t, err)
	serverPair, err := inter.IssueServer(ServerOptions{IPAddresses: []net.IP{net.ParseIP("127.0.0.1")}})
	require.NoError(t, err)
	client, err := inter.IssueClient(ClientOptions{Identity: testIdentity})
	require.NoError(t, err)

	// Both sides trust the root only; each must send the intermediate.
	server := startTLSServer(t, ServerTLSConfig(reloaderFor(t, serverPair), root.CertPool()))
	state, err := dial(server.addr, ClientTLSConfig(root.CertPool(), reloaderFor(t, client)))
	require.NoError(t, err)
	res := server.result(t)
	require.NoError(t, res.err)
	require.Equal(t, testIdentity, res.identity)
	require.Len(t, state.PeerCertificates, 2, "the server sent leaf and intermediate")
	require.Equal(t, inter.Certificate().Raw, state.PeerCertificates[1].Raw)
	require.Len(t, state.VerifiedChains[0], 3, "leaf, intermediate, root")
}
