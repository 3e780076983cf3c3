package agent

import (
	"context"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"
	"github.com/tokenbroker/tokenbroker/agent/config"
)

func TestExpiriesAreComputedAtScrapeTime(t *testing.T) {
	t.Parallel()
	f := newRefresherFixture(t, config.RefreshConfig{}, &memOutput{name: "a"})
	p := newTestPKI(t, f.clock)
	holder := &identityHolder{}
	c := newExpiryCollector(f.clock.Now, []*refresher{f.r}, holder)

	// Nothing held yet: no samples rather than made-up ones.
	require.NoError(t, testutil.CollectAndCompare(c, strings.NewReader("")))

	f.r.step(context.Background())
	holder.set(p.identity(t)) // 24h from t0
	want := func(cred, cert int) string {
		return strings.NewReplacer("CRED", strconv.Itoa(cred), "CERT", strconv.Itoa(cert)).Replace(`
# HELP tokenbroker_agent_certificate_expiry_seconds Seconds until the agent's client certificate expires.
# TYPE tokenbroker_agent_certificate_expiry_seconds gauge
tokenbroker_agent_certificate_expiry_seconds CERT
# HELP tokenbroker_agent_credential_expiry_seconds Seconds until the credential of a target expires: the earliest expiry among its outputs.
# TYPE tokenbroker_agent_credential_expiry_seconds gauge
tokenbroker_agent_credential_expiry_seconds{target="east"} CRED
`)
	}
	require.NoError(t, testutil.CollectAndCompare(c, strings.NewReader(want(3600, 86400))))
	f.clock.Step(10 * time.Minute)
	require.NoError(t, testutil.CollectAndCompare(c, strings.NewReader(want(3000, 85800))), "no stale value")
	f.clock.Step(2 * time.Hour)
	require.NoError(t, testutil.CollectAndCompare(c, strings.NewReader(want(-4200, 78600))), "negative once expired")
}

func TestRefreshOutcomesAreCountedPerTarget(t *testing.T) {
	t.Parallel()
	f := newRefresherFixture(t, config.RefreshConfig{}, &memOutput{name: "a"})
	f.r.step(context.Background())
	f.broker.setFail(errBrokerDown)
	f.clock.SetTime(t0.Add(40 * time.Minute))
	f.r.step(context.Background())
	require.NoError(t, testutil.GatherAndCompare(f.reg, strings.NewReader(`
# HELP tokenbroker_agent_refresh_total Attempts to obtain a credential and write it to every output of a target, by result (success, failure).
# TYPE tokenbroker_agent_refresh_total counter
tokenbroker_agent_refresh_total{result="failure",target="east"} 1
tokenbroker_agent_refresh_total{result="success",target="east"} 1
# HELP tokenbroker_agent_output_writes_total Writes of a credential to an output, by result (written, unchanged, failed).
# TYPE tokenbroker_agent_output_writes_total counter
tokenbroker_agent_output_writes_total{output="mem:a",result="failed",target="east"} 0
tokenbroker_agent_output_writes_total{output="mem:a",result="unchanged",target="east"} 0
tokenbroker_agent_output_writes_total{output="mem:a",result="written",target="east"} 1
`), "tokenbroker_agent_refresh_total", "tokenbroker_agent_output_writes_total"))
}
