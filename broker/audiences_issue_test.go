package broker

import (
	"context"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/broker/audit"
	"github.com/tokenbroker/tokenbroker/broker/problem"
)

// The issuance and the exec kubeconfig under a grant that lists no
// audiences (testPolicy's flux/reader) and one that lists "aud"
// (argo/admiralty-source). This file uses nothing but the broker's API, so
// that it runs against the broker before grants had audiences too.

func TestAnUnlistedAudienceIsRefusedBeforeAnythingIsCreatedAndAuditedAsSuch(t *testing.T) {
	t.Parallel()
	e, reg, _ := newMetricsEnv(t)
	rec := newAuditRecorder()
	e.b.cfg.Auditor = rec
	ctx := context.Background()
	req := apiv1.KubeconfigRequest{Namespace: "flux", ServiceAccount: "reader", Audiences: []string{"sts.amazonaws.com"}}

	_, err := e.b.IssueKubeconfig(ctx, west, req)
	require.Equal(t, problem.KindForbidden, problem.KindOf(err))
	require.Zero(t, e.leaseCount(t))
	require.Empty(t, e.iss.got, "no token is asked for")

	// The exec kubeconfig, which the credential plugin's --audience
	// flags come from, is decided alike.
	_, err = e.b.ExecKubeconfig(ctx, west, req, "https://broker.example:8443")
	require.Equal(t, problem.KindForbidden, problem.KindOf(err))

	evs := rec.all()
	require.Len(t, evs, 2)
	for _, ev := range evs {
		require.Equal(t, audit.DecisionDeny, ev.Decision)
		require.Equal(t, "a grant covers the request but does not list all the audiences it names", ev.Reason)
	}
	require.NoError(t, testutil.GatherAndCompare(reg, strings.NewReader(`
# HELP tokenbroker_denials_total Refused requests, by action (issue, revoke, enroll, renew, authenticate) and reason code.
# TYPE tokenbroker_denials_total counter
tokenbroker_denials_total{action="exec_kubeconfig",reason="audience_not_granted"} 1
tokenbroker_denials_total{action="issue",reason="audience_not_granted"} 1
`), "tokenbroker_denials_total"))

	// The grant that lists the audience gives it, and the issuer is asked
	// for exactly that audience.
	_, err = e.b.IssueKubeconfig(ctx, west, apiv1.KubeconfigRequest{Namespace: "argo", ServiceAccount: "admiralty-source", Audiences: []string{"aud"}})
	require.NoError(t, err)
	require.Equal(t, []string{"aud"}, e.iss.got[0].Audiences)
}
