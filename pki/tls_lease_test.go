package pki

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"net"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// TestTheAPIProfileRefusesALeaseCertificate: a lease certificate chains to
// the client CAs when the signing CA is among them (as it is in every
// deployment), and still fails the API profile's handshake; the lease
// gateway's profile takes it.
func TestTheAPIProfileRefusesALeaseCertificate(t *testing.T) {
	t.Parallel()
	// Real time: the handshake checks validity with the system clock.
	ca, err := NewCA(CAOptions{CommonName: "lease profile test CA"})
	require.NoError(t, err)
	serverPair, err := ca.IssueServer(ServerOptions{IPAddresses: []net.IP{net.ParseIP("127.0.0.1")}})
	require.NoError(t, err)
	serverCerts := reloaderFor(t, serverPair)
	peer, err := ClusterIdentity("oc.example", "west")
	require.NoError(t, err)
	pub, keyPEM, err := ca.NewLeaseKey()
	require.NoError(t, err)
	lease, err := ca.SignLease(pub, LeaseName{Namespace: "argo", ServiceAccount: "runner", ID: "abcdefghijklmnopqrstuvwxyz",
		UID: "0b6c1d7e-3f5a-4c2b-9d8e-7a6f5e4d3c2b", Peer: peer}, time.Now().Add(time.Hour))
	require.NoError(t, err)
	lease.KeyPEM = keyPEM
	require.True(t, IsLeaseCertificate(lease.Cert))
	peerPair, err := ca.IssueClient(ClientOptions{Identity: peer})
	require.NoError(t, err)

	bundle := filepath.Join(t.TempDir(), "client-ca.crt")
	require.NoError(t, os.WriteFile(bundle, ca.BundlePEM(), 0o644))
	pool, err := NewPoolReloader(bundle)
	require.NoError(t, err)

	for name, cfg := range map[string]*tls.Config{
		"ServerTLSConfig":          ServerTLSConfig(serverCerts, ca.CertPool()),
		"ServerTLSConfigReloading": ServerTLSConfigReloading(serverCerts, pool),
	} {
		t.Run(name+" fails the handshake of a lease certificate and takes a peer's.", func(t *testing.T) {
			t.Parallel()
			server := startTLSServer(t, cfg)
			_, err := dial(server.addr, ClientTLSConfig(ca.CertPool(), reloaderFor(t, lease)))
			require.ErrorContains(t, err, "bad certificate", "the client reads the server's alert")
			res := server.result(t)
			var refused *LeaseCertificateError
			require.ErrorAs(t, res.err, &refused)
			require.Equal(t, lease.Cert.Raw, refused.Certificate.Raw)

			_, err = dial(server.addr, ClientTLSConfig(ca.CertPool(), reloaderFor(t, peerPair)))
			require.NoError(t, err)
			res = server.result(t)
			require.NoError(t, res.err)
			require.Equal(t, peer, res.identity)
		})
	}

	t.Run("GatewayTLSConfig takes the lease certificate.", func(t *testing.T) {
		t.Parallel()
		server := startTLSServer(t, GatewayTLSConfig(serverCerts, ca.CertPool, time.Now))
		_, err := dial(server.addr, ClientTLSConfig(ca.CertPool(), reloaderFor(t, lease)))
		require.NoError(t, err, "the handshake succeeds and the server writes")
		// The test server then looks for a SPIFFE identity, which a lease
		// certificate has not: that is its only complaint.
		res := server.result(t)
		require.ErrorIs(t, res.err, ErrInvalidIdentity)
		// The connection state carries the chain as crypto/tls verified
		// it, the signing CA's certificate last: what the gateway checks
		// against the deny list.
		require.Len(t, res.chains, 1)
		require.Equal(t, [][]byte{lease.Cert.Raw, ca.Certificate().Raw}, [][]byte{res.chains[0][0].Raw, res.chains[0][1].Raw})
	})

	t.Run("GatewayTLSConfig verifies against the roots as they are at each handshake.", func(t *testing.T) {
		t.Parallel()
		var mu sync.Mutex
		roots := ca.CertPool()
		current := func() *x509.CertPool {
			mu.Lock()
			defer mu.Unlock()
			return roots
		}
		server := startTLSServer(t, GatewayTLSConfig(serverCerts, current, time.Now))
		_, err := dial(server.addr, ClientTLSConfig(ca.CertPool(), reloaderFor(t, lease)))
		require.NoError(t, err)
		require.ErrorIs(t, server.result(t).err, ErrInvalidIdentity, "verified, then the test server's own complaint")

		other, err := NewCA(CAOptions{CommonName: "another CA"})
		require.NoError(t, err)
		for _, pool := range []*x509.CertPool{other.CertPool(), nil} {
			mu.Lock()
			roots = pool // the signing CA rotated out; then no roots at all
			mu.Unlock()
			_, err = dial(server.addr, ClientTLSConfig(ca.CertPool(), reloaderFor(t, lease)))
			require.Error(t, err)
			var unknown x509.UnknownAuthorityError
			require.ErrorAs(t, server.result(t).err, &unknown)
		}
	})

	t.Run("RefuseLeaseCertificate lets every other state through.", func(t *testing.T) {
		t.Parallel()
		require.NoError(t, RefuseLeaseCertificate(tls.ConnectionState{}))
		require.NoError(t, RefuseLeaseCertificate(tls.ConnectionState{PeerCertificates: []*x509.Certificate{peerPair.Cert}}))
		err := RefuseLeaseCertificate(tls.ConnectionState{PeerCertificates: []*x509.Certificate{lease.Cert}})
		var refused *LeaseCertificateError
		require.True(t, errors.As(err, &refused))
	})
}
