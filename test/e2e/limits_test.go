package e2e

import (
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/test/testcluster"
)

// TestPerPeerLimitsAgainstARealAPIServer runs the broker with a policy
// whose peer west may issue 3 times in a burst, 6 a minute, and hold 4
// leases, and rogue (another peer) its own bucket: west's fourth request in
// a row is 429 with a Retry-After after which it succeeds; at 4 live
// leases it is 429 until one is revoked, counted by the broker's lease
// informer from the real API server; rogue is unaffected throughout.
func TestPerPeerLimitsAgainstARealAPIServer(t *testing.T) {
	c := testcluster.Start(t)
	setUpTarget(t, c)
	e := newBrokerEnv(t, c)
	writeFile(t, e.policy, fmt.Sprintf(`cluster: {name: east, server: %s, caFile: cluster-ca.crt}
limits: {issuancesPerMinute: 6, burst: 3, maxLiveLeases: 4}
peers:
  - name: west
    identity: spiffe://e2e.example/cluster/west
    grants: [{namespaces: [argo], serviceAccounts: [runner]}]
  - name: rogue
    identity: spiffe://e2e.example/cluster/rogue
    limits: {burst: 10}
    grants: [{namespaces: [argo], serviceAccounts: [runner]}]
`, c.URL))
	e.launch(t)
	west, rogue := filepath.Join(e.dir, "west"), filepath.Join(e.dir, "rogue")
	const body = `{"namespace":"argo","serviceAccount":"runner"}`
	post := func(client string) (int, string, http.Header) {
		t.Helper()
		hdrs := filepath.Join(t.TempDir(), "headers")
		status, out := e.postKubeconfig(t, client, body, "-D", hdrs)
		b, err := os.ReadFile(hdrs)
		require.NoError(t, err)
		raw := string(b)
		h := http.Header{}
		for _, line := range strings.Split(raw, "\r\n") {
			if k, v, ok := strings.Cut(line, ": "); ok {
				h.Add(k, v)
			}
		}
		return status, out, h
	}
	var leases []string
	for i := range 3 {
		status, out, _ := post(west)
		require.Equal(t, 201, status, "request %d of the burst: %s", i, out)
		var resp apiv1.KubeconfigResponse
		require.NoError(t, json.Unmarshal([]byte(out), &resp))
		leases = append(leases, resp.LeaseID)
	}

	t.Run("over its rate a peer gets 429 with Retry-After, and succeeds after waiting that long", func(t *testing.T) {
		status, out, h := post(west)
		require.Equal(t, http.StatusTooManyRequests, status, out)
		require.Contains(t, out, "urn:tokenbroker:problem:too-many-requests")
		require.Contains(t, out, "peer west is over its limit of 6 issuances a minute (burst 3)")
		wait, err := strconv.Atoi(h.Get("Retry-After"))
		require.NoError(t, err, "Retry-After: %q", h.Get("Retry-After"))
		require.True(t, wait >= 1 && wait <= 10, "a token every 10 s: %d", wait)
		require.Len(t, leaseIDs(t, e, westIdentityDir(t, e)), 3, "the refusal created nothing")

		status, out, _ = post(rogue)
		require.Equal(t, 201, status, "another peer has its own bucket: %s", out)

		time.Sleep(time.Duration(wait) * time.Second) // the wait the broker asked for, on the real clock
		status, out, _ = post(west)
		require.Equal(t, 201, status, "after Retry-After: %s", out)
		var resp apiv1.KubeconfigResponse
		require.NoError(t, json.Unmarshal([]byte(out), &resp))
		leases = append(leases, resp.LeaseID)
	})

	t.Run("at maxLiveLeases a peer gets 429 until one lease is revoked; whoami shows the usage", func(t *testing.T) {
		require.Len(t, leases, 4)
		status, out, err := e.curl(t, west, "https://"+e.api+"/v1/whoami")
		require.NoError(t, err)
		require.Equal(t, 200, status)
		var who apiv1.WhoAmI
		require.NoError(t, json.Unmarshal([]byte(out), &who))
		require.Equal(t, &apiv1.PeerLimits{IssuancesPerMinute: 6, Burst: 3, RenewalsPerMinute: 6, MaxLiveLeases: 4, LiveLeases: 4}, who.Limits)

		time.Sleep(10 * time.Second) // a token back in the bucket, so that only the quota refuses
		status, out, h := post(west)
		require.Equal(t, http.StatusTooManyRequests, status, out)
		require.Contains(t, out, "holds its maxLiveLeases of 4 live leases")
		require.Equal(t, "60", h.Get("Retry-After"))

		status, _, err = e.curl(t, west, "-X", "DELETE", "https://"+e.api+"/v1/leases/"+leases[0])
		require.NoError(t, err)
		require.Equal(t, 204, status)
		require.Eventually(t, func() bool {
			_, out, err := e.curl(t, west, "https://"+e.api+"/v1/whoami")
			return err == nil && strings.Contains(out, `"liveLeases":3`)
		}, 10*time.Second, 100*time.Millisecond, "the informer sees the revocation")
		status, out, _ = post(west)
		require.Equal(t, 201, status, "a revoked lease frees its place, and the refusal by the quota took no token of the rate: %s", out)
	})

	t.Run("a second replica counts the same live leases: the quota holds across replicas", func(t *testing.T) {
		r := e.replica(t) // ready only once its lease informer has synced
		status, out, err := r.curl(t, west, "https://"+r.api+"/v1/whoami")
		require.NoError(t, err)
		require.Equal(t, 200, status)
		require.Contains(t, out, `"liveLeases":4`, "the replica sees the leases the first one issued")
		status, out = r.postKubeconfig(t, west, body)
		require.Equal(t, http.StatusTooManyRequests, status, out)
		require.Contains(t, out, "holds its maxLiveLeases of 4 live leases")
	})

	t.Run("the refusals are counted by peer and reason", func(t *testing.T) {
		var limitedLines []string
		for _, l := range strings.Split(run(t, "curl", "-sSf", "http://"+e.ops+"/metrics"), "\n") {
			if strings.HasPrefix(l, "tokenbroker_limited_total{") {
				limitedLines = append(limitedLines, l)
			}
		}
		require.Equal(t, []string{
			`tokenbroker_limited_total{peer="west",reason="issuance_rate"} 1`,
			`tokenbroker_limited_total{peer="west",reason="max_live_leases"} 1`,
		}, limitedLines, "rogue was never limited (and the replica counts its own)")
	})
}
