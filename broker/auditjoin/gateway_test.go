package auditjoin_test

import (
	"encoding/json"
	"fmt"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/tokenbroker/tokenbroker/broker/audit"
	"github.com/tokenbroker/tokenbroker/broker/auditjoin"
)

const gatewayLease = "cccccccccccccccccccccccccc"

// A lease gateway's request reaches the API server with the gateway's own
// token, whose credential id no lease names: it joins its lease by the
// audit id the broker recorded, and only if its user is the lease's.
func TestAGatewayRequestJoinsItsLeaseByTheAuditIDTheBrokerRecorded(t *testing.T) {
	t.Parallel()
	broker := strings.Join([]string{
		`{"time":"2030-01-01T10:00:00Z","audit":"tokenbroker.io/v1","action":"issue","decision":"allow","peer":"west","identity":"spiffe://oc.example/cluster/west","namespace":"argo","service_account":"runner","credential":"token","access":"gateway","lease_id":"` + gatewayLease + `","certificate_serial":"2a","credential_id":"X509SHA256=aa","expires_at":"2030-01-01T12:00:00Z"}`,
		`{"time":"2030-01-01T10:01:00Z","audit":"tokenbroker.io/v1","action":"gateway_request","decision":"allow","identity":"spiffe://oc.example/cluster/west","namespace":"argo","service_account":"runner","lease_id":"` + gatewayLease + `","access":"gateway","method":"GET","path":"/api/v1/namespaces/argo/configmaps","status":200,"api_audit_id":"5b0d6c1e-0000-4000-8000-000000000001"}`,
		`{"time":"2030-01-01T10:02:00Z","audit":"tokenbroker.io/v1","action":"gateway_request","decision":"allow","identity":"spiffe://oc.example/cluster/west","namespace":"argo","service_account":"runner","lease_id":"` + gatewayLease + `","access":"gateway","method":"GET","path":"/api/v1/namespaces/argo/secrets","status":403,"api_audit_id":"5b0d6c1e-0000-4000-8000-000000000002"}`,
	}, "\n") + "\n"
	withID := func(line, id string) string {
		var ev map[string]any
		require.NoError(t, json.Unmarshal([]byte(line), &ev))
		ev["auditID"] = id
		b, err := json.Marshal(ev)
		require.NoError(t, err)
		return string(b)
	}
	const gatewayCred = "JTI=99999999-0000-4000-8000-000000000000" // the gateway's own token
	api := strings.Join([]string{
		withID(apiEvent(at(1), "ResponseComplete", "list", saUser, gatewayCred, "configmaps", "argo", 200), "5b0d6c1e-0000-4000-8000-000000000001"),
		// Another user under a recorded id: not the lease's request.
		withID(apiEvent(at(2), "ResponseComplete", "list", "system:serviceaccount:argo:other", gatewayCred, "secrets", "argo", 403), "5b0d6c1e-0000-4000-8000-000000000002"),
		// A request the gateway did not record.
		withID(apiEvent(at(3), "ResponseComplete", "list", saUser, gatewayCred, "configmaps", "argo", 200), "5b0d6c1e-0000-4000-8000-000000000003"),
	}, "\n") + "\n"
	idx := auditjoin.NewIndex()
	_, err := idx.ReadBrokerLog(strings.NewReader(broker))
	require.NoError(t, err)
	var rows []auditjoin.Row
	st, err := auditjoin.Join(strings.NewReader(api), idx, auditjoin.Filter{}, func(r auditjoin.Row) error {
		rows = append(rows, r)
		return nil
	})
	require.NoError(t, err)
	require.Len(t, rows, 1)
	require.Equal(t, gatewayLease, rows[0].Lease.ID)
	require.Equal(t, "west", rows[0].Lease.Peer)
	require.Equal(t, 1, st.Gateway)
	require.Equal(t, 1, st.WrongUser, "a recorded audit id under another user joins nothing")
	require.Equal(t, 1, st.NoLease, "an unrecorded request of the gateway's token")
}

// gatewayEvent is a broker audit event of the lease gateway for lease,
// with the api_audit_id id.
func gatewayEvent(t *testing.T, action, lease, id string, extra map[string]any) string {
	t.Helper()
	ev := map[string]any{
		"time": "2030-01-01T10:01:00Z", "audit": audit.Schema, "action": action, "decision": audit.DecisionAllow,
		"identity": "spiffe://oc.example/cluster/west", "namespace": "argo", "service_account": "runner",
		"lease_id": lease, "access": "gateway", "method": "GET", "path": "/api/v1/namespaces/argo/configmaps", "api_audit_id": id,
	}
	for k, v := range extra {
		ev[k] = v
	}
	b, err := json.Marshal(ev)
	require.NoError(t, err)
	return string(b)
}

// gatewayIssue is the issue event of gatewayLease (and of lease, if given).
func gatewayIssue(lease string) string {
	return `{"time":"2030-01-01T10:00:00Z","audit":"tokenbroker.io/v1","action":"issue","decision":"allow","peer":"west","identity":"spiffe://oc.example/cluster/west","namespace":"argo","service_account":"runner","credential":"token","access":"gateway","lease_id":"` + lease + `","certificate_serial":"2a","credential_id":"X509SHA256=` + lease + `","expires_at":"2030-01-01T12:00:00Z"}`
}

// apiEventWithID is apiEvent under the audit id id, through the gateway's
// own token.
func apiEventWithID(t *testing.T, id string, minute int, stage, verb, user, resource string, code int) string {
	t.Helper()
	var ev map[string]any
	require.NoError(t, json.Unmarshal([]byte(apiEvent(at(minute), stage, verb, user, "JTI=99999999-0000-4000-8000-000000000000", resource, "argo", code)), &ev))
	ev["auditID"] = id
	b, err := json.Marshal(ev)
	require.NoError(t, err)
	return string(b)
}

func lines(l ...string) string { return strings.Join(l, "\n") + "\n" }

func readBroker(t *testing.T, log string, opts ...auditjoin.IndexOption) *auditjoin.Index {
	t.Helper()
	idx := auditjoin.NewIndex(opts...)
	st, err := idx.ReadBrokerLog(strings.NewReader(log))
	require.NoError(t, err)
	require.Zero(t, st.Malformed)
	return idx
}

const (
	watchID = "5b0d6c1e-0000-4000-8000-0000000000a1"
	execID  = "5b0d6c1e-0000-4000-8000-0000000000a2"
	listID  = "5b0d6c1e-0000-4000-8000-0000000000a3"
)

// A stream whose replica died (or whose end is past the log read) has no
// gateway_request: its gateway_forward, or its gateway_upgrade alone,
// joins the API server's events to the lease, and the join says it is
// known only from its start. The user check still holds.
func TestAStreamKnownOnlyFromItsStartJoinsItsLease(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name, action string
		extra        map[string]any
		id           string
		verb, res    string
	}{
		{"a watch by its gateway_forward", audit.ActionGatewayForward, map[string]any{"path": "/api/v1/namespaces/argo/configmaps"}, watchID, "watch", "configmaps"},
		{"an exec by its gateway_upgrade", audit.ActionGatewayUpgrade, map[string]any{"path": "/api/v1/namespaces/argo/pods/p/exec", "status": 101}, execID, "create", "pods"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			idx := readBroker(t, lines(gatewayIssue(gatewayLease), gatewayEvent(t, tc.action, gatewayLease, tc.id, tc.extra)))
			require.Equal(t, auditjoin.GatewayStats{Requests: 1, Open: 1, Limit: auditjoin.DefaultMaxGatewayRequests}, idx.Gateway())
			rows, st := joinAll(t, idx, lines(
				apiEventWithID(t, tc.id, 1, "ResponseStarted", tc.verb, saUser, tc.res, 200),
				apiEventWithID(t, tc.id, 1, "ResponseComplete", tc.verb, saUser, tc.res, 200),
				// Another user under the stream's id is not the lease's.
				apiEventWithID(t, tc.id, 2, "ResponseComplete", tc.verb, "system:serviceaccount:argo:other", tc.res, 200),
			))
			require.Len(t, rows, 1, "the stream is one request: its ResponseComplete")
			require.Equal(t, gatewayLease, rows[0].Lease.ID)
			require.Equal(t, tc.verb, rows[0].Verb)
			require.Equal(t, 1, st.Gateway)
			require.Equal(t, 1, st.GatewayOpen, "known only from the start of its stream")
			require.Equal(t, 1, st.WrongUser)
		})
	}
}

// The gateway_forward, gateway_upgrade and gateway_request events of one
// request name one request: indexed once, joined once, and no longer open
// once its end is read, whatever the order of the logs read.
func TestAStreamsStartAndEndEventsAreOneRequest(t *testing.T) {
	t.Parallel()
	start := []string{
		gatewayIssue(gatewayLease),
		gatewayEvent(t, audit.ActionGatewayForward, gatewayLease, watchID, nil),
		gatewayEvent(t, audit.ActionGatewayForward, gatewayLease, execID, nil),
		gatewayEvent(t, audit.ActionGatewayUpgrade, gatewayLease, execID, map[string]any{"status": 101}),
	}
	end := []string{
		gatewayEvent(t, audit.ActionGatewayRequest, gatewayLease, listID, map[string]any{"status": 200, "duration_ms": 3}),
		gatewayEvent(t, audit.ActionGatewayRequest, gatewayLease, watchID, map[string]any{"status": 200, "duration_ms": 4000}),
		// A stream ended by an upstream failure is still the API server's
		// request.
		gatewayEvent(t, audit.ActionGatewayRequest, gatewayLease, execID, map[string]any{"decision": audit.DecisionError, "status": 502}),
	}
	api := lines(
		apiEventWithID(t, listID, 1, "ResponseComplete", "list", saUser, "configmaps", 200),
		apiEventWithID(t, watchID, 1, "ResponseStarted", "watch", saUser, "configmaps", 200),
		apiEventWithID(t, execID, 2, "ResponseStarted", "create", saUser, "pods", 101),
		apiEventWithID(t, watchID, 1, "ResponseComplete", "watch", saUser, "configmaps", 200),
		apiEventWithID(t, execID, 2, "ResponseComplete", "create", saUser, "pods", 101),
	)
	for name, log := range map[string]string{
		"start then end": lines(append(start, end...)...),
		"end then start": lines(append(append([]string{start[0]}, end...), start[1:]...)...),
		"read twice":     lines(append(append(start, end...), append(start, end...)...)...),
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			idx := readBroker(t, log)
			require.Equal(t, auditjoin.GatewayStats{Requests: 3, Limit: auditjoin.DefaultMaxGatewayRequests}, idx.Gateway())
			rows, st := joinAll(t, idx, api)
			require.Len(t, rows, 3)
			require.Equal(t, 3, st.Gateway)
			require.Zero(t, st.GatewayOpen)
			n, _ := idx.Conflicts()
			require.Zero(t, n)
		})
	}
}

// Past the limit, a new request's gateway events are counted, not
// dropped silently: the count says how many requests at least, and their
// API server events join nothing. Requests already indexed still get
// their end.
func TestGatewayRequestsPastTheLimitAreCountedNotDroppedSilently(t *testing.T) {
	t.Parallel()
	id := func(n int) string { return fmt.Sprintf("5b0d6c1e-0000-4000-8000-%012d", n) }
	log := lines(
		gatewayIssue(gatewayLease),
		gatewayEvent(t, audit.ActionGatewayForward, gatewayLease, id(1), nil),
		gatewayEvent(t, audit.ActionGatewayRequest, gatewayLease, id(2), nil),
		// The limit (2) is reached: the next requests are not indexed.
		gatewayEvent(t, audit.ActionGatewayForward, gatewayLease, id(3), nil),
		gatewayEvent(t, audit.ActionGatewayUpgrade, gatewayLease, id(3), nil),
		gatewayEvent(t, audit.ActionGatewayRequest, gatewayLease, id(4), nil),
		gatewayEvent(t, audit.ActionGatewayRequest, gatewayLease, id(3), nil),
		gatewayEvent(t, audit.ActionGatewayRequest, gatewayLease, id(5), nil),
		// An indexed stream's end is still read.
		gatewayEvent(t, audit.ActionGatewayRequest, gatewayLease, id(1), nil),
	)
	idx := readBroker(t, log, auditjoin.WithMaxGatewayRequests(2))
	require.Equal(t, auditjoin.GatewayStats{Requests: 2, NotIndexedEvents: 5, NotIndexed: 3, Limit: 2}, idx.Gateway(),
		"3 gateway_request events not indexed: at least 3 requests")
	var api []string
	for n := 1; n <= 5; n++ {
		api = append(api, apiEventWithID(t, id(n), n, "ResponseComplete", "list", saUser, "configmaps", 200))
	}
	rows, st := joinAll(t, idx, lines(api...))
	require.Len(t, rows, 2)
	require.Equal(t, 2, st.Gateway)
	require.Zero(t, st.GatewayOpen)
	require.Equal(t, 3, st.NoLease, "the requests not indexed join nothing")

	// The default limit is the one documented.
	require.Equal(t, 2_000_000, auditjoin.NewIndex().Gateway().Limit)
}

// The gateway draws a random audit id per request: two leases under one
// id is a forged or corrupted event. The first stands, the claim is
// counted and both leases are disputed; an overlong id is counted.
func TestGatewayEventsClaimingOneAuditIDForTwoLeasesAreAConflict(t *testing.T) {
	t.Parallel()
	const other = "dddddddddddddddddddddddddd"
	idx := readBroker(t, lines(
		gatewayIssue(gatewayLease), gatewayIssue(other),
		gatewayEvent(t, audit.ActionGatewayForward, gatewayLease, watchID, nil),
		gatewayEvent(t, audit.ActionGatewayRequest, other, watchID, nil),
		gatewayEvent(t, audit.ActionGatewayRequest, other, strings.Repeat("a", auditjoin.MaxAuditIDBytes+1), nil),
	))
	n, notes := idx.Conflicts()
	require.Equal(t, 1, n)
	require.Contains(t, notes[0], watchID)
	require.Equal(t, auditjoin.GatewayStats{Requests: 1, Open: 1, BadAuditID: 1, Limit: auditjoin.DefaultMaxGatewayRequests}, idx.Gateway())
	rows, _ := joinAll(t, idx, lines(apiEventWithID(t, watchID, 1, "ResponseComplete", "watch", saUser, "configmaps", 200)))
	require.Len(t, rows, 1)
	require.Equal(t, gatewayLease, rows[0].Lease.ID)
	require.True(t, rows[0].Lease.Disputed)
}

// The actions the join reads are the ones the broker writes.
func TestTheGatewayActionsAreTheBrokers(t *testing.T) {
	t.Parallel()
	require.Equal(t, "gateway_forward", audit.ActionGatewayForward)
	require.Equal(t, "gateway_upgrade", audit.ActionGatewayUpgrade)
	require.Equal(t, "gateway_request", audit.ActionGatewayRequest)
}
