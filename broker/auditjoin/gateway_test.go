package auditjoin_test

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

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
