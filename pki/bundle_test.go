package pki

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestVerifyBundleFingerprint(t *testing.T) {
	t.Parallel()
	root, inter := newTestIntermediate(t)
	other := newTestCA(t)
	leaf := issueServer(t, root, "broker")
	rootFP := Fingerprint(root.Certificate())
	bundle := append(other.CertPEM(), root.CertPEM()...)

	tests := []struct {
		name        string
		bundle      []byte
		fingerprint string
		wantErr     string
		wantErrIs   error
	}{
		{name: "A bundle holding the pinned root is accepted.", bundle: root.CertPEM(), fingerprint: rootFP},
		{name: "A rotation bundle holding the pinned root second is accepted.", bundle: bundle, fingerprint: rootFP},
		{name: "An upper-case fingerprint is accepted.", bundle: root.CertPEM(), fingerprint: "sha256:" + strings.ToUpper(strings.TrimPrefix(rootFP, "sha256:"))},
		{name: "An intermediate CA may be pinned too.", bundle: append(inter.CertPEM(), root.CertPEM()...), fingerprint: Fingerprint(inter.Certificate())},
		{name: "A bundle without the pinned CA is refused.", bundle: other.CertPEM(), fingerprint: rootFP, wantErrIs: ErrFingerprintMismatch},
		{name: "A pinned certificate that is not a CA is refused.", bundle: append(leaf.CertPEM, root.CertPEM()...), fingerprint: Fingerprint(leaf.Cert), wantErrIs: ErrFingerprintMismatch},
		{name: "A bundle with trailing garbage is refused even if it holds the CA.", bundle: append(root.CertPEM(), "garbage"...), fingerprint: rootFP, wantErr: "outside PEM blocks"},
		{name: "An empty bundle is refused.", bundle: nil, fingerprint: rootFP, wantErr: "no PEM certificate"},
		{name: "A fingerprint without the sha256 prefix is refused.", bundle: root.CertPEM(), fingerprint: strings.TrimPrefix(rootFP, "sha256:"), wantErr: "invalid fingerprint"},
		{name: "A truncated fingerprint is refused.", bundle: root.CertPEM(), fingerprint: rootFP[:len(rootFP)-2], wantErr: "invalid fingerprint"},
		{name: "A fingerprint that is not hex is refused.", bundle: root.CertPEM(), fingerprint: rootFP[:len(rootFP)-2] + "zz", wantErr: "invalid fingerprint"},
		{name: "An empty fingerprint is refused.", bundle: root.CertPEM(), fingerprint: "", wantErr: "invalid fingerprint"},
		{name: "A SHA-1 style fingerprint is refused.", bundle: root.CertPEM(), fingerprint: "sha1:" + strings.TrimPrefix(rootFP, "sha256:"), wantErr: "invalid fingerprint"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			err := VerifyBundleFingerprint(tt.bundle, tt.fingerprint)
			switch {
			case tt.wantErrIs != nil:
				require.ErrorIs(t, err, tt.wantErrIs)
			case tt.wantErr != "":
				require.ErrorContains(t, err, tt.wantErr)
			default:
				require.NoError(t, err)
			}
		})
	}
}

func writeBundle(t *testing.T, file string, cas ...*CA) {
	t.Helper()
	var data []byte
	for _, ca := range cas {
		data = append(data, ca.BundlePEM()...)
	}
	require.NoError(t, WriteCertificatesFile(file, data, true))
}

func TestPoolReloader(t *testing.T) {
	t.Parallel()
	a, b := newTestCA(t), newTestCA(t)

	t.Run("A new bundle is served once the interval has passed and the callback reports success.", func(t *testing.T) {
		t.Parallel()
		file := filepath.Join(t.TempDir(), "bundle.crt")
		writeBundle(t, file, a)
		clock := newFakeClock(testNow)
		var rec callbackRecorder
		p, err := NewPoolReloader(file, WithReloadClock(clock.Now), WithReloadCallback(rec.record))
		require.NoError(t, err)
		require.True(t, p.Pool().Equal(poolOf(a.Certificate())))
		require.Equal(t, a.CertPEM(), p.PEM())

		writeBundle(t, file, a, b)
		require.True(t, p.Pool().Equal(poolOf(a.Certificate())), "the file is not read again within the interval")
		clock.Add(DefaultReloadInterval)
		require.True(t, p.Pool().Equal(poolOf(a.Certificate(), b.Certificate())))
		require.Equal(t, []*x509.Certificate{a.Certificate(), b.Certificate()}, p.Certificates())
		require.Equal(t, append(a.CertPEM(), b.CertPEM()...), p.PEM())
		require.Equal(t, []error{nil}, rec.all())

		clock.Add(DefaultReloadInterval)
		_ = p.Pool()
		require.Equal(t, []error{nil}, rec.all(), "an unchanged file is not reported again")
	})

	t.Run("Bad new files keep the old bundle in service and the callback gets each error once.", func(t *testing.T) {
		t.Parallel()
		file := filepath.Join(t.TempDir(), "bundle.crt")
		writeBundle(t, file, a)
		var rec callbackRecorder
		p, err := NewPoolReloader(file, WithReloadInterval(0), WithReloadClock(fixedNow), WithReloadCallback(rec.record))
		require.NoError(t, err)
		leaf := issueServer(t, a, "broker")

		steps := []struct {
			write   func()
			wantErr string
		}{
			{write: func() { require.NoError(t, os.WriteFile(file, nil, 0o644)) }, wantErr: "no PEM certificate"},
			{write: func() { require.NoError(t, os.WriteFile(file, []byte("garbage"), 0o644)) }, wantErr: "outside PEM blocks"},
			{write: func() { require.NoError(t, os.WriteFile(file, leaf.CertPEM, 0o644)) }, wantErr: "is not a CA certificate"},
			{write: func() { require.NoError(t, os.Remove(file)) }, wantErr: "no such file"},
		}
		for i, s := range steps {
			s.write()
			require.True(t, p.Pool().Equal(poolOf(a.Certificate())))
			require.True(t, p.Pool().Equal(poolOf(a.Certificate())))
			require.Equal(t, a.CertPEM(), p.PEM())
			errs := rec.all()
			require.Len(t, errs, i+1, "each bad state is reported once")
			require.ErrorContains(t, errs[i], s.wantErr)
		}

		writeBundle(t, file, b)
		require.True(t, p.Pool().Equal(poolOf(b.Certificate())))
		errs := rec.all()
		require.Len(t, errs, len(steps)+1)
		require.NoError(t, errs[len(steps)])
	})

	t.Run("Reload reads the file at once and returns the outcome.", func(t *testing.T) {
		t.Parallel()
		file := filepath.Join(t.TempDir(), "bundle.crt")
		writeBundle(t, file, a)
		p, err := NewPoolReloader(file, WithReloadInterval(time.Hour), WithReloadClock(fixedNow))
		require.NoError(t, err)
		require.NoError(t, p.Reload())
		require.NoError(t, os.WriteFile(file, []byte("garbage"), 0o644))
		require.ErrorContains(t, p.Reload(), "outside PEM blocks")
		require.True(t, p.Pool().Equal(poolOf(a.Certificate())))
	})

	t.Run("A bad bundle at start is an error.", func(t *testing.T) {
		t.Parallel()
		dir := t.TempDir()
		_, err := NewPoolReloader(filepath.Join(dir, "missing.crt"))
		require.ErrorContains(t, err, "no such file")
		empty := filepath.Join(dir, "empty.crt")
		require.NoError(t, os.WriteFile(empty, []byte("\n"), 0o644))
		_, err = NewPoolReloader(empty)
		require.ErrorContains(t, err, "no PEM certificate")
	})
}

func TestServerTLSConfigReloadingFollowsTheBundleFile(t *testing.T) {
	t.Parallel()
	// Real time: the handshake checks validity with the system clock.
	serverCA, err := NewCA(CAOptions{CommonName: "server CA"})
	require.NoError(t, err)
	oldCA, err := NewCA(CAOptions{CommonName: "old client CA"})
	require.NoError(t, err)
	newRoot, err := NewCA(CAOptions{CommonName: "new client root", PathLen: 1})
	require.NoError(t, err)
	newCA, err := newRoot.NewIntermediate(CAOptions{CommonName: "new client intermediate"})
	require.NoError(t, err)
	serverPair, err := serverCA.IssueServer(ServerOptions{IPAddresses: []net.IP{net.ParseIP("127.0.0.1")}})
	require.NoError(t, err)
	id, err := ClusterIdentity("oc.example", "west")
	require.NoError(t, err)
	oldClient, err := oldCA.IssueClient(ClientOptions{Identity: id})
	require.NoError(t, err)
	newClient, err := newCA.IssueClient(ClientOptions{Identity: id})
	require.NoError(t, err)

	file := filepath.Join(t.TempDir(), "client-ca.crt")
	writeBundle(t, file, oldCA)
	var rec callbackRecorder
	bundle, err := NewPoolReloader(file, WithReloadInterval(0), WithReloadCallback(rec.record))
	require.NoError(t, err)
	cfg := ServerTLSConfigReloading(reloaderFor(t, serverPair), bundle)
	require.Equal(t, uint16(tls.VersionTLS13), cfg.MinVersion)
	require.Equal(t, tls.RequireAndVerifyClientCert, cfg.ClientAuth)
	server := startTLSServer(t, cfg)

	connect := func(t *testing.T, client *KeyPair) (serverResult, error) {
		t.Helper()
		_, err := dial(server.addr, ClientTLSConfig(serverCA.CertPool(), reloaderFor(t, client)))
		return server.result(t), err
	}

	res, err := connect(t, oldClient)
	require.NoError(t, err)
	require.NoError(t, res.err)
	require.Equal(t, id, res.identity)

	res, err = connect(t, newClient)
	require.Error(t, err, "the new CA is not trusted yet")
	require.ErrorContains(t, res.err, "unknown authority")

	// Rotation step 1: both CAs in the bundle, no restart.
	writeBundle(t, file, oldCA, newRoot)
	res, err = connect(t, newClient)
	require.NoError(t, err, "a client of the added CA is accepted, with its intermediate from the client's chain")
	require.NoError(t, res.err)
	require.Equal(t, id, res.identity)
	res, err = connect(t, oldClient)
	require.NoError(t, err)
	require.NoError(t, res.err)

	// Rotation step 2: the old CA leaves the bundle.
	writeBundle(t, file, newRoot)
	res, err = connect(t, oldClient)
	require.Error(t, err, "a client of the removed CA is refused")
	require.ErrorContains(t, res.err, "unknown authority")
	res, err = connect(t, newClient)
	require.NoError(t, err)
	require.NoError(t, res.err)

	// A broken bundle file keeps the last good one.
	require.NoError(t, os.WriteFile(file, []byte("garbage"), 0o644))
	res, err = connect(t, newClient)
	require.NoError(t, err)
	require.NoError(t, res.err)
	errs := rec.all()
	require.NotEmpty(t, errs)
	require.ErrorContains(t, errs[len(errs)-1], "outside PEM blocks")
}

func TestEnrollmentTLSConfig(t *testing.T) {
	t.Parallel()
	ca, err := NewCA(CAOptions{CommonName: "enrollment test CA"})
	require.NoError(t, err)
	serverPair, err := ca.IssueServer(ServerOptions{IPAddresses: []net.IP{net.ParseIP("127.0.0.1")}})
	require.NoError(t, err)
	certs := reloaderFor(t, serverPair)
	cfg := EnrollmentTLSConfig(certs)
	require.Equal(t, tls.NoClientCert, cfg.ClientAuth)

	// A plain listener: the shared helper expects a client certificate.
	ln, err := tls.Listen("tcp", "127.0.0.1:0", cfg)
	require.NoError(t, err)
	t.Cleanup(func() { _ = ln.Close() })
	results := make(chan error, 4)
	go func() {
		for {
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer conn.Close()
				tc := conn.(*tls.Conn)
				_ = tc.SetDeadline(time.Now().Add(10 * time.Second))
				err := tc.Handshake()
				if err == nil && len(tc.ConnectionState().PeerCertificates) != 0 {
					err = errNoPeerCertExpected
				}
				results <- err
				if err == nil {
					_, _ = tc.Write([]byte("ok\n"))
				}
			}()
		}
	}()
	result := func(t *testing.T) error {
		t.Helper()
		select {
		case err := <-results:
			return err
		case <-time.After(10 * time.Second):
			t.Fatal("the server reported no handshake")
			return nil
		}
	}

	// The subtests share the listener's result channel, so they run in
	// order, not in parallel.
	t.Run("A client without a certificate completes a TLS 1.3 handshake.", func(t *testing.T) {
		state, err := dial(ln.Addr().String(), ClientTLSConfig(ca.CertPool(), nil))
		require.NoError(t, err)
		require.NoError(t, result(t))
		require.Equal(t, uint16(tls.VersionTLS13), state.Version)
		require.Equal(t, serverPair.Cert.Raw, state.PeerCertificates[0].Raw)
	})
	t.Run("A client with a certificate is not asked for it.", func(t *testing.T) {
		client := issueClientNow(t, ca)
		_, err := dial(ln.Addr().String(), ClientTLSConfig(ca.CertPool(), reloaderFor(t, client)))
		require.NoError(t, err)
		require.NoError(t, result(t))
	})
	t.Run("A TLS 1.2-only client is refused.", func(t *testing.T) {
		c := ClientTLSConfig(ca.CertPool(), nil)
		c.MinVersion, c.MaxVersion = tls.VersionTLS12, tls.VersionTLS12
		_, err := dial(ln.Addr().String(), c)
		require.Error(t, err)
		require.ErrorContains(t, result(t), "unsupported versions")
	})
}

var errNoPeerCertExpected = errors.New("the enrollment listener received a client certificate")

func issueClientNow(t *testing.T, ca *CA) *KeyPair {
	t.Helper()
	kp, err := ca.IssueClient(ClientOptions{Identity: testIdentity})
	require.NoError(t, err)
	return kp
}

func TestWriteCertificatesFile(t *testing.T) {
	t.Parallel()
	ca := newTestCA(t)
	file := filepath.Join(t.TempDir(), "bundle.crt")
	require.NoError(t, WriteCertificatesFile(file, ca.CertPEM(), false))
	require.Equal(t, os.FileMode(0o644), fileMode(t, file))
	require.ErrorIs(t, WriteCertificatesFile(file, ca.CertPEM(), false), os.ErrExist)
	require.NoError(t, WriteCertificatesFile(file, newTestCA(t).CertPEM(), true))
	require.Error(t, WriteCertificatesFile("", nil, true))
}
