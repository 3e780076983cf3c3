package pki

import (
	"crypto/tls"
	"crypto/x509"
	"io"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// tlsServer is a TLS listener on 127.0.0.1 with the production server
// profile. Each accepted connection completes the handshake, reports the
// outcome and, if it succeeded, writes the peer's identity.
type tlsServer struct {
	addr    string
	results chan serverResult
}

type serverResult struct {
	err      error
	identity string
	version  uint16
	chains   [][]*x509.Certificate // the verified chains
}

func startTLSServer(t *testing.T, cfg *tls.Config) *tlsServer {
	t.Helper()
	ln, err := tls.Listen("tcp", "127.0.0.1:0", cfg)
	require.NoError(t, err)
	t.Cleanup(func() { _ = ln.Close() })
	s := &tlsServer{addr: ln.Addr().String(), results: make(chan serverResult, 16)}
	go func() {
		for {
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			go s.handle(conn.(*tls.Conn))
		}
	}()
	return s
}

func (s *tlsServer) handle(conn *tls.Conn) {
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(10 * time.Second))
	if err := conn.Handshake(); err != nil {
		s.results <- serverResult{err: err}
		return
	}
	state := conn.ConnectionState()
	id, err := IdentityFromCert(state.PeerCertificates[0])
	s.results <- serverResult{err: err, identity: id, version: state.Version, chains: state.VerifiedChains}
	_, _ = io.WriteString(conn, id+"\n")
}

func (s *tlsServer) result(t *testing.T) serverResult {
	t.Helper()
	select {
	case r := <-s.results:
		return r
	case <-time.After(10 * time.Second):
		t.Fatal("the server reported no handshake")
		return serverResult{}
	}
}

// dial connects and reads the server's answer. In TLS 1.3 the client's
// handshake finishes before the server has checked the client certificate,
// so a refusal shows up on the first read.
func dial(addr string, cfg *tls.Config) (*tls.ConnectionState, error) {
	conn, err := tls.DialWithDialer(&net.Dialer{Timeout: 10 * time.Second}, "tcp", addr, cfg)
	if err != nil {
		return nil, err
	}
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(10 * time.Second))
	buf := make([]byte, 256)
	if _, err := conn.Read(buf); err != nil {
		return nil, err
	}
	state := conn.ConnectionState()
	return &state, nil
}

func reloaderFor(t *testing.T, kp *KeyPair) *CertReloader {
	t.Helper()
	certFile, keyFile := writePairFiles(t, t.TempDir(), kp)
	r, err := NewCertReloader(certFile, keyFile)
	require.NoError(t, err)
	return r
}

func TestTLSProfiles(t *testing.T) {
	t.Parallel()
	// Real time: the handshake checks validity with the system clock.
	ca, err := NewCA(CAOptions{CommonName: "tls test CA"})
	require.NoError(t, err)
	other, err := NewCA(CAOptions{CommonName: "other CA"})
	require.NoError(t, err)
	serverPair, err := ca.IssueServer(ServerOptions{DNSNames: []string{"broker.example"}, IPAddresses: []net.IP{net.ParseIP("127.0.0.1")}})
	require.NoError(t, err)
	serverCerts := reloaderFor(t, serverPair)

	id, err := ClusterIdentity("oc.example", "west")
	require.NoError(t, err)
	goodClient, err := ca.IssueClient(ClientOptions{Identity: id})
	require.NoError(t, err)
	foreignClient, err := other.IssueClient(ClientOptions{Identity: id})
	require.NoError(t, err)
	serverAsClient, err := ca.IssueServer(ServerOptions{DNSNames: []string{"west.example"}})
	require.NoError(t, err)

	tests := []struct {
		name          string
		client        func(t *testing.T) *tls.Config
		wantServerErr string
	}{
		{
			name:   "A TLS 1.3 client with a certificate from the CA is accepted and identified.",
			client: func(t *testing.T) *tls.Config { return ClientTLSConfig(ca.CertPool(), reloaderFor(t, goodClient)) },
		},
		{
			name: "A TLS 1.2-only client is refused.",
			client: func(t *testing.T) *tls.Config {
				cfg := ClientTLSConfig(ca.CertPool(), reloaderFor(t, goodClient))
				cfg.MinVersion, cfg.MaxVersion = tls.VersionTLS12, tls.VersionTLS12
				return cfg
			},
			wantServerErr: "unsupported versions",
		},
		{
			name:          "A client without a certificate is refused.",
			client:        func(*testing.T) *tls.Config { return ClientTLSConfig(ca.CertPool(), nil) },
			wantServerErr: "didn't provide a certificate",
		},
		{
			name:          "A client with a certificate from another CA is refused.",
			client:        func(t *testing.T) *tls.Config { return ClientTLSConfig(ca.CertPool(), reloaderFor(t, foreignClient)) },
			wantServerErr: "unknown authority",
		},
		{
			name:          "A client presenting a server certificate from the right CA is refused for its key usage.",
			client:        func(t *testing.T) *tls.Config { return ClientTLSConfig(ca.CertPool(), reloaderFor(t, serverAsClient)) },
			wantServerErr: "incompatible key usage",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			server := startTLSServer(t, ServerTLSConfig(serverCerts, ca.CertPool()))
			state, err := dial(server.addr, tt.client(t))
			res := server.result(t)
			if tt.wantServerErr != "" {
				require.Error(t, err)
				require.ErrorContains(t, res.err, tt.wantServerErr)
				return
			}
			require.NoError(t, err)
			require.NoError(t, res.err)
			require.Equal(t, id, res.identity)
			require.Equal(t, uint16(tls.VersionTLS13), res.version)
			require.Equal(t, uint16(tls.VersionTLS13), state.Version)
			require.Equal(t, serverPair.Cert.Raw, state.PeerCertificates[0].Raw)
		})
	}

	t.Run("A client refuses a server whose CA it does not trust.", func(t *testing.T) {
		t.Parallel()
		server := startTLSServer(t, ServerTLSConfig(serverCerts, ca.CertPool()))
		_, err := dial(server.addr, ClientTLSConfig(other.CertPool(), reloaderFor(t, goodClient)))
		var unknown x509.UnknownAuthorityError
		require.ErrorAs(t, err, &unknown)
		require.Error(t, server.result(t).err)
	})
}

func TestServerCertificateRotatesWithoutRestart(t *testing.T) {
	t.Parallel()
	ca, err := NewCA(CAOptions{})
	require.NoError(t, err)
	first, err := ca.IssueServer(ServerOptions{IPAddresses: []net.IP{net.ParseIP("127.0.0.1")}})
	require.NoError(t, err)
	second, err := ca.IssueServer(ServerOptions{IPAddresses: []net.IP{net.ParseIP("127.0.0.1")}})
	require.NoError(t, err)
	client, err := ca.IssueClient(ClientOptions{Identity: "spiffe://oc.example/cluster/west"})
	require.NoError(t, err)

	dir := t.TempDir()
	certFile, keyFile := filepath.Join(dir, "tls.crt"), filepath.Join(dir, "tls.key")
	require.NoError(t, first.WriteFiles(certFile, keyFile))
	reloaded := make(chan error, 4)
	certs, err := NewCertReloader(certFile, keyFile, WithReloadInterval(0), WithReloadCallback(func(err error) { reloaded <- err }))
	require.NoError(t, err)
	server := startTLSServer(t, ServerTLSConfig(certs, ca.CertPool()))
	clientCfg := ClientTLSConfig(ca.CertPool(), reloaderFor(t, client))

	state, err := dial(server.addr, clientCfg)
	require.NoError(t, err)
	require.NoError(t, server.result(t).err)
	require.Equal(t, first.Cert.Raw, state.PeerCertificates[0].Raw)

	require.NoError(t, second.WriteFiles(certFile, keyFile))
	state, err = dial(server.addr, clientCfg)
	require.NoError(t, err)
	require.NoError(t, server.result(t).err)
	require.Equal(t, second.Cert.Raw, state.PeerCertificates[0].Raw)
	require.NoError(t, <-reloaded)

	// Broken files: the server keeps its certificate and keeps working.
	require.NoError(t, os.WriteFile(certFile, []byte("broken"), 0o644))
	state, err = dial(server.addr, clientCfg)
	require.NoError(t, err)
	require.NoError(t, server.result(t).err)
	require.Equal(t, second.Cert.Raw, state.PeerCertificates[0].Raw)
	require.Error(t, <-reloaded)
}

func TestTLSProfileSettings(t *testing.T) {
	t.Parallel()
	ca := newTestCA(t)
	r, err := NewCertReloader(writePairFiles(t, t.TempDir(), issueServer(t, ca, "broker")))
	require.NoError(t, err)
	s := ServerTLSConfig(r, ca.CertPool())
	require.Equal(t, uint16(tls.VersionTLS13), s.MinVersion)
	require.Equal(t, tls.RequireAndVerifyClientCert, s.ClientAuth)
	require.NotNil(t, s.GetCertificate)
	require.Empty(t, s.Certificates)
	require.False(t, s.InsecureSkipVerify)

	c := ClientTLSConfig(ca.CertPool(), nil)
	require.Equal(t, uint16(tls.VersionTLS13), c.MinVersion)
	require.Nil(t, c.GetClientCertificate)
	require.False(t, c.InsecureSkipVerify)
	require.NotNil(t, ClientTLSConfig(ca.CertPool(), r).GetClientCertificate)
}
