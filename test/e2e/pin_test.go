package e2e

import (
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

	"github.com/stretchr/testify/require"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/pki"
)

// TestEnrollSendsTheJoinTokenOnlyToABrokerOfThePinnedCA is the black-box
// exploit of issue #27 against the real binary: a fake enrollment server
// serves a trust bundle of the operators' CA and its own, with a server
// certificate of its own CA. "tokenbroker enroll --ca-fingerprint <the
// operators' CA>" must refuse it before the join token is sent.
func TestEnrollSendsTheJoinTokenOnlyToABrokerOfThePinnedCA(t *testing.T) {
	bin := tokenbrokerBinary(t)
	dir := t.TempDir()
	pkiDir := filepath.Join(dir, "pki")
	run(t, bin, "pki", "init", "--dir", pkiDir)
	// The token is made here, so that the test runs any release's binary.
	ca, err := pki.LoadCA(filepath.Join(pkiDir, "ca.crt"), filepath.Join(pkiDir, "ca.key"))
	require.NoError(t, err)
	token, _, err := ca.IssueJoinToken(pki.JoinTokenOptions{Identity: "spiffe://e2e.example/cluster/north", Audiences: []string{"east"}})
	require.NoError(t, err)
	fp := pki.Fingerprint(ca.Certificate())
	real, err := os.ReadFile(filepath.Join(pkiDir, "bundle.crt"))
	require.NoError(t, err)

	attacker, err := pki.NewCA(pki.CAOptions{CommonName: "attacker CA"})
	require.NoError(t, err)
	kp, err := attacker.IssueServer(pki.ServerOptions{IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1)}})
	require.NoError(t, err)
	cert, err := kp.TLSCertificate()
	require.NoError(t, err)
	var (
		mu       sync.Mutex
		received []string
	)
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/v1/trust-bundle" {
			w.Header().Set("Content-Type", apiv1.MediaTypeJSON)
			_ = json.NewEncoder(w).Encode(apiv1.TrustBundle{CABundle: string(real) + string(attacker.BundlePEM())})
			return
		}
		mu.Lock()
		received = append(received, r.Header.Get("Authorization"))
		mu.Unlock()
		w.WriteHeader(http.StatusServiceUnavailable)
	}))
	srv.TLS = &tls.Config{MinVersion: tls.VersionTLS13, Certificates: []tls.Certificate{cert}}
	srv.StartTLS()
	defer srv.Close()

	tokenFile := writeFile(t, filepath.Join(dir, "north.token"), token)
	_, stderr, err := runErr(bin, "enroll", "--broker", srv.URL, "--ca-fingerprint", fp, "--token-file", tokenFile, "--dir", filepath.Join(dir, "north"))
	require.Error(t, err)
	require.Contains(t, stderr, "does not chain to the pinned CA")
	require.NotContains(t, stderr, strings.TrimSpace(token))
	mu.Lock()
	defer mu.Unlock()
	require.Empty(t, received, "the join token never reaches the fake broker")
	_, err = os.Stat(filepath.Join(dir, "north", "tls.key"))
	require.ErrorIs(t, err, os.ErrNotExist, "nothing is written")
}
