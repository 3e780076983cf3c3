package agent

import (
	"context"
	"crypto/tls"
	"encoding/json"
	"fmt"
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

	"github.com/tokenbroker/tokenbroker/agent/config"
	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/pki"
)

// pinServer is an enrollment listener that someone else may run: it serves
// a chosen trust bundle with a server certificate from a chosen CA, signs
// CSRs with real, and answers with a chosen caBundle. It records every
// bearer token it is sent.
type pinServer struct {
	srv *httptest.Server

	mu     sync.Mutex
	tokens []string
}

type pinServerOptions struct {
	signer   *pki.CA // signs the server certificate
	bundle   []byte  // served by GET /v1/trust-bundle
	real     *pki.CA // signs the client certificate
	caBundle []byte  // the caBundle of the enrollment answer
}

func newPinServer(t *testing.T, o pinServerOptions) *pinServer {
	t.Helper()
	kp, err := o.signer.IssueServer(pki.ServerOptions{IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1)}})
	require.NoError(t, err)
	cert, err := kp.TLSCertificate()
	require.NoError(t, err)
	s := &pinServer{}
	s.srv = httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", apiv1.MediaTypeJSON)
		switch r.URL.Path {
		case "/v1/trust-bundle":
			_ = json.NewEncoder(w).Encode(apiv1.TrustBundle{CABundle: string(o.bundle)})
		case "/v1/certificates":
			s.mu.Lock()
			s.tokens = append(s.tokens, strings.TrimPrefix(r.Header.Get("Authorization"), "Bearer "))
			s.mu.Unlock()
			var req apiv1.CertificateRequest
			if json.NewDecoder(r.Body).Decode(&req) != nil {
				w.WriteHeader(http.StatusBadRequest)
				return
			}
			csr, identity, err := pki.ParseCSRPEM([]byte(req.CSR))
			if err != nil {
				w.WriteHeader(http.StatusBadRequest)
				return
			}
			kp, err := o.real.SignClient(csr, identity, time.Hour)
			if err != nil {
				w.WriteHeader(http.StatusInternalServerError)
				return
			}
			resp := apiv1.CertificateResponse{
				Identity: identity, Certificate: string(kp.CertPEM), SerialNumber: kp.Cert.SerialNumber.Text(16),
				NotBefore: kp.Cert.NotBefore, NotAfter: kp.Cert.NotAfter, CABundle: string(o.caBundle),
			}
			if req.ClusterCACSR != "" {
				caCSR, caIdentity, err := pki.ParseCSRPEM([]byte(req.ClusterCACSR))
				if err != nil {
					w.WriteHeader(http.StatusBadRequest)
					return
				}
				ca, err := o.real.SignClusterCA(caCSR, caIdentity, time.Hour)
				if err != nil {
					w.WriteHeader(http.StatusUnprocessableEntity)
					return
				}
				resp.ClusterCA, resp.ClusterCANotAfter = string(ca.CertPEM), &ca.Cert.NotAfter
			}
			w.WriteHeader(http.StatusCreated)
			_ = json.NewEncoder(w).Encode(resp)
		default:
			w.WriteHeader(http.StatusNotFound)
		}
	}))
	s.srv.TLS = &tls.Config{MinVersion: tls.VersionTLS13, Certificates: []tls.Certificate{cert}}
	s.srv.StartTLS()
	t.Cleanup(s.srv.Close)
	return s
}

func (s *pinServer) received() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]string(nil), s.tokens...)
}

// pinCAs are the operators' CA and an attacker's.
func pinCAs(t *testing.T) (real, attacker *pki.CA) {
	t.Helper()
	real, err := pki.NewCA(pki.CAOptions{CommonName: "operators' CA"})
	require.NoError(t, err)
	attacker, err = pki.NewCA(pki.CAOptions{CommonName: "attacker's CA"})
	require.NoError(t, err)
	return real, attacker
}

func TestTheAgentNeverSendsItsJoinTokenToABrokerOutsideThePinnedCA(t *testing.T) {
	t.Parallel()
	real, attacker := pinCAs(t)
	both := append(real.BundlePEM(), attacker.BundlePEM()...)
	tests := []struct {
		name   string
		bundle []byte
	}{
		{name: "a bundle of the pinned CA and the attacker's CA with a certificate from the attacker's CA is refused", bundle: both},
		{name: "a bundle of the attacker's CA and the pinned CA with a certificate from the attacker's CA is refused", bundle: append(attacker.BundlePEM(), real.BundlePEM()...)},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			srv := newPinServer(t, pinServerOptions{signer: attacker, bundle: tc.bundle, real: attacker, caBundle: both})
			dir := t.TempDir()
			token, _, err := real.IssueJoinToken(pki.JoinTokenOptions{Identity: westID})
			require.NoError(t, err)
			tokenFile := filepath.Join(dir, "join.token")
			require.NoError(t, os.WriteFile(tokenFile, []byte(token), 0o600))
			cfg, err := config.Parse(fmt.Appendf(nil, `
identity:
  dir: %[4]q
  enroll: {broker: %[1]q, caFingerprint: %[2]q, tokenFile: %[3]q}
targets:
  - name: east
    broker: %[1]q
    request: {namespace: argo, serviceAccount: admiralty-source, ttl: 1h}
    outputs: [{file: {path: %[5]q}}]
`, srv.srv.URL, pki.Fingerprint(real.Certificate()), tokenFile, filepath.Join(dir, "identity"), filepath.Join(dir, "kubeconfig")), "")
			require.NoError(t, err)
			ln, err := net.Listen("tcp", "127.0.0.1:0")
			require.NoError(t, err)
			a, err := New(cfg, Deps{OpsListener: ln, Clock: newFakeClock(time.Now()), Rand: fixedRand(0)})
			require.NoError(t, err)
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			err = a.Run(ctx)
			require.ErrorContains(t, err, "does not chain to the pinned CA")
			require.Empty(t, srv.received(), "the join token never reaches the attacker")
			_, statErr := os.Stat(filepath.Join(dir, "identity", CertFile))
			require.ErrorIs(t, statErr, os.ErrNotExist, "no identity is stored")
		})
	}
}

func TestEnrollmentKeepsThePinnedBundleNotTheAnswers(t *testing.T) {
	t.Parallel()
	real, attacker := pinCAs(t)
	pin := pki.Fingerprint(real.Certificate())
	tests := []struct {
		name     string
		caBundle []byte
		wantErr  string
	}{
		{name: "an answer whose caBundle lacks the pinned CA is refused and nothing is stored", caBundle: attacker.BundlePEM(), wantErr: "the broker's caBundle"},
		{name: "an answer whose caBundle adds the attacker's CA stores only the pinned CA", caBundle: append(real.BundlePEM(), attacker.BundlePEM()...)},
		{name: "an answer whose caBundle is the pinned CA stores it", caBundle: real.BundlePEM()},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			srv := newPinServer(t, pinServerOptions{signer: real, bundle: real.BundlePEM(), real: real, caBundle: tc.caBundle})
			token, _, err := real.IssueJoinToken(pki.JoinTokenOptions{Identity: westID})
			require.NoError(t, err)
			dir := IdentityDir(filepath.Join(t.TempDir(), "identity"))
			_, err = Enroll(context.Background(), EnrollOptions{BrokerURL: srv.srv.URL, Fingerprint: pin, Token: token, Dir: dir})
			if tc.wantErr != "" {
				require.ErrorContains(t, err, tc.wantErr)
				require.ErrorIs(t, err, pki.ErrFingerprintMismatch)
				_, statErr := os.Stat(dir.Bundle())
				require.ErrorIs(t, statErr, os.ErrNotExist, "nothing is stored")
				return
			}
			require.NoError(t, err)
			stored, err := os.ReadFile(dir.Bundle())
			require.NoError(t, err)
			require.Equal(t, string(real.BundlePEM()), string(stored), "only the pinned CA is trusted")
		})
	}
}
