package main

import (
	"bytes"
	"context"
	"crypto/tls"
	"encoding/json"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/pki"
)

// fakeEnrollmentServer is an enrollment listener run by whoever holds
// signer: it serves bundle as the trust bundle with a server certificate
// from signer, signs CSRs with issuer and answers with caBundle. It
// records the bearer tokens it receives.
type fakeEnrollmentServer struct {
	url    string
	mu     sync.Mutex
	tokens []string
}

func newFakeEnrollmentServer(t *testing.T, signer, issuer *pki.CA, bundle, caBundle []byte) *fakeEnrollmentServer {
	t.Helper()
	kp, err := signer.IssueServer(pki.ServerOptions{IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1)}})
	require.NoError(t, err)
	cert, err := kp.TLSCertificate()
	require.NoError(t, err)
	f := &fakeEnrollmentServer{}
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", apiv1.MediaTypeJSON)
		if r.URL.Path == "/v1/trust-bundle" {
			_ = json.NewEncoder(w).Encode(apiv1.TrustBundle{CABundle: string(bundle)})
			return
		}
		f.mu.Lock()
		f.tokens = append(f.tokens, strings.TrimPrefix(r.Header.Get("Authorization"), "Bearer "))
		f.mu.Unlock()
		var req apiv1.CertificateRequest
		_ = json.NewDecoder(r.Body).Decode(&req)
		csr, identity, err := pki.ParseCSRPEM([]byte(req.CSR))
		if err != nil {
			w.WriteHeader(http.StatusBadRequest)
			return
		}
		kp, err := issuer.SignClient(csr, identity, time.Hour)
		if err != nil {
			w.WriteHeader(http.StatusInternalServerError)
			return
		}
		resp := apiv1.CertificateResponse{
			Identity: identity, Certificate: string(kp.CertPEM), SerialNumber: kp.Cert.SerialNumber.Text(16),
			NotBefore: kp.Cert.NotBefore, NotAfter: kp.Cert.NotAfter, CABundle: string(caBundle),
		}
		if req.ClusterCACSR != "" {
			caCSR, caIdentity, err := pki.ParseCSRPEM([]byte(req.ClusterCACSR))
			if err != nil {
				w.WriteHeader(http.StatusBadRequest)
				return
			}
			ca, err := issuer.SignClusterCA(caCSR, caIdentity, time.Hour)
			if err != nil {
				w.WriteHeader(http.StatusUnprocessableEntity)
				return
			}
			resp.ClusterCA = string(ca.CertPEM)
		}
		w.WriteHeader(http.StatusCreated)
		_ = json.NewEncoder(w).Encode(resp)
	}))
	srv.TLS = &tls.Config{MinVersion: tls.VersionTLS13, Certificates: []tls.Certificate{cert}}
	srv.StartTLS()
	t.Cleanup(srv.Close)
	f.url = srv.URL
	return f
}

func (f *fakeEnrollmentServer) received() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]string(nil), f.tokens...)
}

func TestEnrollTrustsThePinnedCAAlone(t *testing.T) {
	t.Parallel()
	real, err := pki.NewCA(pki.CAOptions{CommonName: "operators' CA"})
	require.NoError(t, err)
	attacker, err := pki.NewCA(pki.CAOptions{CommonName: "attacker's CA"})
	require.NoError(t, err)
	both := append(real.BundlePEM(), attacker.BundlePEM()...)

	tests := []struct {
		name       string
		signer     *pki.CA // the server certificate's CA
		bundle     []byte  // the trust bundle served
		caBundle   []byte  // the enrollment answer's caBundle
		wantErr    string  // "" means enrolled
		wantToken  bool    // the server receives the join token
		wantBundle []byte  // ca.crt as written
	}{
		{name: "a server certificate from a second CA of a two-CA bundle never receives the join token",
			signer: attacker, bundle: both, caBundle: both, wantErr: "does not chain to the pinned CA"},
		{name: "a server certificate from a CA listed before the pinned one never receives the join token",
			signer: attacker, bundle: append(attacker.BundlePEM(), real.BundlePEM()...), caBundle: both, wantErr: "does not chain to the pinned CA"},
		{name: "an answer whose caBundle lacks the pinned CA is refused and nothing is written",
			signer: real, bundle: real.BundlePEM(), caBundle: attacker.BundlePEM(), wantErr: "no CA in the trust bundle has the pinned fingerprint", wantToken: true},
		{name: "a second CA in the served bundle or the answer is not written to ca.crt",
			signer: real, bundle: both, caBundle: both, wantToken: true, wantBundle: real.BundlePEM()},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			srv := newFakeEnrollmentServer(t, tc.signer, tc.signer, tc.bundle, tc.caBundle)
			token, _, err := real.IssueJoinToken(pki.JoinTokenOptions{Identity: "spiffe://oc.example/cluster/west"})
			require.NoError(t, err)
			tmp := t.TempDir()
			tokenFile := filepath.Join(tmp, "west.token")
			require.NoError(t, os.WriteFile(tokenFile, []byte(token), 0o600))
			dir := filepath.Join(tmp, "west-identity")

			cmd := newRootCommand()
			cmd.SilenceUsage, cmd.SilenceErrors = true, true
			var out bytes.Buffer
			cmd.SetOut(&out)
			cmd.SetErr(&out)
			cmd.SetArgs([]string{"enroll", "--broker", srv.url, "--ca-fingerprint", pki.Fingerprint(real.Certificate()),
				"--token-file", tokenFile, "--dir", dir})
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			err = cmd.ExecuteContext(ctx)

			if tc.wantToken {
				require.Equal(t, []string{token}, srv.received())
			} else {
				require.Empty(t, srv.received(), "the join token never leaves for a server outside the pinned CA")
			}
			if tc.wantErr != "" {
				require.ErrorContains(t, err, tc.wantErr)
				_, statErr := os.Stat(filepath.Join(dir, "ca.crt"))
				require.ErrorIs(t, statErr, os.ErrNotExist, "nothing is written")
				return
			}
			require.NoError(t, err)
			written, err := os.ReadFile(filepath.Join(dir, "ca.crt"))
			require.NoError(t, err)
			require.Equal(t, string(tc.wantBundle), string(written))
		})
	}
}

func TestEnrollWithClusterCAWritesTheClusterCAsFiles(t *testing.T) {
	t.Parallel()
	fleet, err := pki.NewCA(pki.CAOptions{CommonName: "operators' CA", PathLen: 1})
	require.NoError(t, err)
	srv := newFakeEnrollmentServer(t, fleet, fleet, fleet.BundlePEM(), fleet.BundlePEM())
	token, _, err := fleet.IssueJoinToken(pki.JoinTokenOptions{Identity: "spiffe://oc.example/cluster/west"})
	require.NoError(t, err)
	tmp := t.TempDir()
	tokenFile := filepath.Join(tmp, "west.token")
	require.NoError(t, os.WriteFile(tokenFile, []byte(token), 0o600))
	dir := filepath.Join(tmp, "west-identity")

	cmd := newRootCommand()
	cmd.SilenceUsage, cmd.SilenceErrors = true, true
	var out bytes.Buffer
	cmd.SetOut(&out)
	cmd.SetErr(&out)
	cmd.SetArgs([]string{"enroll", "--broker", srv.url, "--ca-fingerprint", pki.Fingerprint(fleet.Certificate()),
		"--token-file", tokenFile, "--dir", dir, "--cluster-ca"})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	require.NoError(t, cmd.ExecuteContext(ctx))
	require.Contains(t, out.String(), filepath.Join(dir, "cluster-ca.crt"))
	certPEM, err := os.ReadFile(filepath.Join(dir, "cluster-ca.crt"))
	require.NoError(t, err)
	keyPEM, err := os.ReadFile(filepath.Join(dir, "cluster-ca.key"))
	require.NoError(t, err)
	ca, err := pki.ParseCA(certPEM, keyPEM, pki.CAOptions{})
	require.NoError(t, err)
	id, err := pki.ClusterCAIdentity(ca.Certificate())
	require.NoError(t, err)
	require.Equal(t, "spiffe://oc.example/cluster/west", id)
	require.NotContains(t, out.String(), string(keyPEM), "the key is never printed")
}
