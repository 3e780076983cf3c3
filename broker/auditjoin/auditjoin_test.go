package auditjoin_test

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	rbacv1 "k8s.io/api/rbac/v1"

	"github.com/tokenbroker/tokenbroker/broker/audit"
	"github.com/tokenbroker/tokenbroker/broker/auditjoin"
)

const (
	tokenLease = "aaaaaaaaaaaaaaaaaaaaaaaaaa"
	certLease  = "bbbbbbbbbbbbbbbbbbbbbbbbbb"
	tokenCred  = "JTI=0f0e0d0c-1111-2222-3333-444455556666"
	certCred   = "X509SHA256=9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
)

// brokerLog is a broker's output: audit events among operational lines.
var brokerLog = strings.Join([]string{
	`{"level":"info","ts":"2030-01-01T10:00:00Z","msg":"decision","allowed":true}`,
	`{"time":"2030-01-01T10:00:00Z","audit":"tokenbroker.io/v1","action":"issue","decision":"allow","request_id":"REQ1","identity":"spiffe://oc.example/cluster/west","peer":"west","namespace":"argo","service_account":"runner","credential":"token","lease_id":"` + tokenLease + `","token_jti":"0f0e0d0c-1111-2222-3333-444455556666","credential_id":"` + tokenCred + `","expires_at":"2030-01-01T12:00:00Z","workload":"wf/submitter","grant":"runners"}`,
	`{"time":"2030-01-01T10:00:01Z","audit":"tokenbroker.io/v1","action":"issue","decision":"allow","request_id":"REQ2","identity":"spiffe://oc.example/cluster/west","peer":"west","namespace":"argo","user":"tokenbroker:west:abc","credential":"clientCertificate","lease_id":"` + certLease + `","certificate_serial":"1f","credential_id":"` + certCred + `","expires_at":"2030-01-01T12:00:00Z","grant":"certs"}`,
	`{"time":"2030-01-01T10:00:02Z","audit":"tokenbroker.io/v1","action":"issue","decision":"deny","reason":"no grant allows this request","peer":"west"}`,
	`not json at all`,
	`{"time":"2030-01-01T10:30:00Z","audit":"tokenbroker.io/v1","action":"revoke","decision":"allow","request_id":"REQ3","peer":"west","lease_id":"` + certLease + `"}`,
}, "\n") + "\n"

func apiEvent(t time.Time, stage, verb, user, cred, resource, ns string, code int) string {
	ev := map[string]any{
		"kind": "Event", "apiVersion": "audit.k8s.io/v1", "level": "Metadata", "auditID": fmt.Sprintf("id-%d", t.UnixNano()),
		"stage": stage, "verb": verb, "requestURI": "/api/v1/namespaces/" + ns + "/" + resource,
		"responseStatus":           map[string]any{"metadata": map[string]any{}, "code": code},
		"requestReceivedTimestamp": t.Format(time.RFC3339Nano), "stageTimestamp": t.Format(time.RFC3339Nano),
	}
	if user != "" {
		u := map[string]any{"username": user, "groups": []string{"system:authenticated"}}
		if cred != "" {
			u["extra"] = map[string][]string{auditjoin.CredentialIDKey: {cred}}
		}
		ev["user"] = u
	}
	if resource != "" {
		ev["objectRef"] = map[string]any{"resource": resource, "namespace": ns, "apiVersion": "v1"}
	}
	b, _ := json.Marshal(ev)
	return string(b)
}

func at(min int) time.Time { return time.Date(2030, 1, 1, 10, min, 0, 0, time.UTC) }

const saUser = "system:serviceaccount:argo:runner"
const certUser = "tokenbroker:west:abc"

var apiLog = strings.Join([]string{
	apiEvent(at(1), "RequestReceived", "list", saUser, tokenCred, "configmaps", "argo", 0),
	apiEvent(at(1), "ResponseComplete", "list", saUser, tokenCred, "configmaps", "argo", 200),
	apiEvent(at(2), "ResponseComplete", "delete", saUser, tokenCred, "configmaps", "argo", 403),
	apiEvent(at(3), "ResponseComplete", "get", certUser, certCred, "configmaps", "argo", 200),
	apiEvent(at(4), "ResponseComplete", "list", "system:admin", "X509SHA256=other", "secrets", "argo", 200),
	apiEvent(at(31), "ResponseComplete", "get", certUser, certCred, "configmaps", "argo", 403),
	apiEvent(at(32), "ResponseStarted", "list", "", "", "configmaps", "argo", 401),
	`{"kind":"Event","apiVersion":"audit.k8s.io/v1","stage":"ResponseComplete","verb":"get","requestURI":"/version","user":{"username":"` + saUser + `","extra":{"` + auditjoin.CredentialIDKey + `":["` + tokenCred + `"]}},"responseStatus":{"code":200},"requestReceivedTimestamp":"2030-01-01T10:05:00Z"}`,
	`{"kind":"Policy","apiVersion":"audit.k8s.io/v1"}`,
}, "\n") + "\n"

func index(t *testing.T) *auditjoin.Index {
	t.Helper()
	idx := auditjoin.NewIndex()
	st, err := idx.ReadBrokerLog(strings.NewReader(brokerLog))
	require.NoError(t, err)
	require.Equal(t, 6, st.Lines)
	require.Equal(t, 4, st.Events, "the operational line and the line that is not JSON are not events")
	require.Zero(t, st.Malformed)
	require.Equal(t, 2, idx.Len())
	return idx
}

func join(t *testing.T, f auditjoin.Filter) ([]auditjoin.Row, auditjoin.Stats) {
	t.Helper()
	var rows []auditjoin.Row
	st, err := auditjoin.Join(strings.NewReader(apiLog), index(t), f, func(r auditjoin.Row) error {
		rows = append(rows, r)
		return nil
	})
	require.NoError(t, err)
	return rows, st
}

func TestEveryRequestMadeWithABrokerCredentialIsAttributedToItsLease(t *testing.T) {
	t.Parallel()
	rows, st := join(t, auditjoin.Filter{})
	require.Len(t, rows, 5)
	require.Equal(t, 7, st.Requests, "RequestReceived and non-events are not requests")
	require.Equal(t, 5, st.Joined)
	require.Equal(t, 1, st.NoLease, "the admin's request")
	require.Equal(t, 1, st.Unauthenticated, "the 401 carries no credential id")
	require.Equal(t, 1, st.Malformed, "the Policy line is not an event")

	list := rows[0]
	require.Equal(t, "list", list.Verb)
	require.Equal(t, "configmaps", list.Resource)
	require.Equal(t, "argo", list.Namespace)
	require.Equal(t, 200, list.Code)
	require.Equal(t, tokenLease, list.Lease.ID)
	require.Equal(t, "west", list.Lease.Peer)
	require.Equal(t, "wf/submitter", list.Lease.Workload)
	require.Equal(t, "REQ1", list.Lease.IssueRequestID)
	require.Equal(t, "live", list.LeaseState)

	require.Equal(t, 403, rows[1].Code)
	require.Equal(t, certLease, rows[2].Lease.ID)
	require.Equal(t, "live", rows[2].LeaseState)
	require.Equal(t, "/version", rows[4].Path)
	revoked := rows[3]
	require.Equal(t, certLease, revoked.Lease.ID)
	require.Equal(t, 403, revoked.Code)
	require.Equal(t, "revoked", revoked.LeaseState, "received after the lease's revocation")
	require.Equal(t, at(30), revoked.Lease.RevokedAt)
}

func TestFiltersSelectByLeasePeerAndTime(t *testing.T) {
	t.Parallel()
	rows, _ := join(t, auditjoin.Filter{LeaseID: certLease})
	require.Len(t, rows, 2)
	rows, _ = join(t, auditjoin.Filter{Peer: "east"})
	require.Empty(t, rows)
	rows, st := join(t, auditjoin.Filter{Since: at(3)})
	require.Len(t, rows, 3)
	require.Equal(t, 3, st.Joined)
}

func TestALeaseFromItsSecretJoinsWithoutTheBrokerLog(t *testing.T) {
	t.Parallel()
	idx := auditjoin.NewIndex()
	idx.AddLease(auditjoin.Lease{ID: tokenLease, Peer: "west", Namespace: "argo", ServiceAccount: "runner", Credential: "token", CredentialID: tokenCred})
	idx.AddLease(auditjoin.Lease{ID: "cccccccccccccccccccccccccc"}) // no credential id yet: joins nothing
	var rows []auditjoin.Row
	_, err := auditjoin.Join(strings.NewReader(apiLog), idx, auditjoin.Filter{}, func(r auditjoin.Row) error {
		rows = append(rows, r)
		return nil
	})
	require.NoError(t, err)
	require.Len(t, rows, 3)
	require.Equal(t, "west", rows[0].Lease.Peer)
}

func TestTheSummaryListsWhatEachLeaseUsedAndWhatItsRolesNeverUsed(t *testing.T) {
	t.Parallel()
	rows, _ := join(t, auditjoin.Filter{})
	s := auditjoin.NewSummary()
	for _, r := range rows {
		s.Add(r)
	}
	leases := s.Leases()
	require.Len(t, leases, 2)
	tok := leases[0]
	require.Equal(t, tokenLease, tok.Lease.ID)
	require.Equal(t, 3, tok.Requests)
	require.Equal(t, "system:serviceaccount:argo:runner", tok.Subject.String())
	require.Equal(t, []auditjoin.Use{
		{Permission: auditjoin.Permission{Verb: "get", Path: "/version"}, Count: 1},
		{Permission: auditjoin.Permission{Verb: "delete", Resource: "configmaps"}, Count: 1, Denied: 1},
		{Permission: auditjoin.Permission{Verb: "list", Resource: "configmaps"}, Count: 1, AllowedIn: []string{"argo"}},
	}, tok.Uses)
	cert := leases[1]
	require.Equal(t, 1, cert.AfterRevocation)
	require.Equal(t, "tokenbroker:west:abc", cert.Subject.String())

	subjects := s.Subjects()
	require.Len(t, subjects, 2)
	require.Equal(t, "certs", subjects[0].Grant)
	require.Equal(t, "runners", subjects[1].Grant)
	require.Equal(t, []string{tokenLease}, subjects[1].Leases)

	rules := []rbacv1.PolicyRule{
		{Verbs: []string{"get", "list", "watch"}, APIGroups: []string{""}, Resources: []string{"configmaps", "pods/log"}},
		{Verbs: []string{"delete"}, APIGroups: []string{""}, Resources: []string{"configmaps"}},
		{Verbs: []string{"get"}, NonResourceURLs: []string{"/version", "/healthz/*"}},
	}
	unused, _ := auditjoin.Unused(rules, subjects[1].Uses)
	var names []string
	for _, p := range unused {
		names = append(names, p.String())
	}
	require.ElementsMatch(t, []string{"get /healthz/*", "get configmaps", "watch configmaps", "get pods/log", "list pods/log", "watch pods/log", "delete configmaps"}, names,
		"a denied delete does not use the delete right; list configmaps and get /version were used")
}

func TestUnusedMatchesRulesAsRBACDoes(t *testing.T) {
	t.Parallel()
	uses := []auditjoin.Use{
		{Permission: auditjoin.Permission{Verb: "get", Group: "apps", Resource: "deployments/scale"}, Count: 1},
		{Permission: auditjoin.Permission{Verb: "list", Resource: "pods"}, Count: 2},
	}
	for _, tc := range []struct {
		name   string
		rule   rbacv1.PolicyRule
		unused []string
	}{
		{"a verb wildcard is used by any verb", rbacv1.PolicyRule{Verbs: []string{"*"}, APIGroups: []string{""}, Resources: []string{"pods"}}, nil},
		{"a resource wildcard is used by any resource of its group", rbacv1.PolicyRule{Verbs: []string{"get"}, APIGroups: []string{"apps"}, Resources: []string{"*"}}, nil},
		{"*/scale is used by any scale subresource", rbacv1.PolicyRule{Verbs: []string{"get"}, APIGroups: []string{"*"}, Resources: []string{"*/scale"}}, nil},
		{"a resource does not cover its subresource", rbacv1.PolicyRule{Verbs: []string{"get"}, APIGroups: []string{"apps"}, Resources: []string{"deployments"}}, []string{"get apps/deployments"}},
		{"another group's resource of the same name is not used", rbacv1.PolicyRule{Verbs: []string{"list"}, APIGroups: []string{"metrics.k8s.io"}, Resources: []string{"pods"}}, []string{"list metrics.k8s.io/pods"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			var got []string
			unused, _ := auditjoin.Unused([]rbacv1.PolicyRule{tc.rule}, uses)
			for _, p := range unused {
				got = append(got, p.String())
			}
			require.Equal(t, tc.unused, got)
		})
	}
}

// TestAnEventTheBrokerWritesIsReadBackAsWritten: the join reads the
// broker's own audit.Event, so what audit.Log writes comes back whole.
func TestAnEventTheBrokerWritesIsReadBackAsWritten(t *testing.T) {
	t.Parallel()
	want := audit.Event{
		Time: time.Date(2030, 1, 1, 10, 0, 0, 0, time.UTC), Audit: audit.Schema, Action: audit.ActionGatewayRequest,
		Decision: audit.DecisionAllow, RequestID: "REQ1", Peer: "west", Namespace: "argo", ServiceAccount: "runner",
		LeaseID: tokenLease, CredentialID: tokenCred, Grant: "runners", Access: "gateway",
		Method: "GET", Path: "/api/v1/pods", Status: 200, APIAuditID: "5b0d6c1e-0000-4000-8000-000000000001", DurationMS: 12,
	}
	var buf bytes.Buffer
	require.NoError(t, audit.NewLog(&buf).Audit(want))
	got, err := auditjoin.ParseBrokerEvent(bytes.TrimSpace(buf.Bytes()))
	require.NoError(t, err)
	require.Equal(t, want, got)
}

func TestOldBrokerEventsJoinByTheTokensJTI(t *testing.T) {
	t.Parallel()
	ev, err := auditjoin.ParseBrokerEvent([]byte(`{"audit":"tokenbroker.io/v1","action":"issue","decision":"allow","lease_id":"x","token_jti":"abc"}`))
	require.NoError(t, err)
	require.Equal(t, "JTI=abc", ev.CredentialID)
}

func TestLinesThatAreNotEventsAreTold(t *testing.T) {
	t.Parallel()
	_, err := auditjoin.ParseBrokerEvent([]byte(`{"msg":"hello"}`))
	require.ErrorIs(t, err, auditjoin.ErrNotEvent)
	_, err = auditjoin.ParseBrokerEvent([]byte(`{"audit":"tokenbroker.io/v1",`))
	require.Error(t, err)
	require.NotErrorIs(t, err, auditjoin.ErrNotEvent)
	_, err = auditjoin.ParseAPIEvent([]byte(`{"kind":"Event","apiVersion":"audit.k8s.io/v1beta1"}`))
	require.ErrorIs(t, err, auditjoin.ErrNotEvent)
}

// streamed is an io.Reader that makes n API server events on the fly,
// one a line, with a line over MaxLineBytes every 1000th: the log exists
// nowhere whole.
type streamed struct {
	n, i int
	buf  []byte
}

func (s *streamed) Read(p []byte) (int, error) {
	for len(s.buf) == 0 {
		if s.i == s.n {
			return 0, io.EOF
		}
		if s.i%1000 == 999 {
			s.buf = append(bytes.Repeat([]byte("x"), auditjoin.MaxLineBytes+10), '\n')
		} else {
			s.buf = []byte(apiEvent(at(1).Add(time.Duration(s.i)*time.Millisecond), "ResponseComplete", "list", saUser, tokenCred, "configmaps", "argo", 200) + "\n")
		}
		s.i++
	}
	n := copy(p, s.buf)
	s.buf = s.buf[n:]
	return n, nil
}

func TestALogOfAnySizeIsStreamedAndOverlongLinesAreSkipped(t *testing.T) {
	t.Parallel()
	const n = 20000
	s := auditjoin.NewSummary()
	st, err := auditjoin.Join(&streamed{n: n}, index(t), auditjoin.Filter{}, func(r auditjoin.Row) error {
		s.Add(r)
		return nil
	})
	require.NoError(t, err)
	require.Equal(t, n, st.Lines)
	require.Equal(t, n/1000, st.TooLong)
	require.Equal(t, n-n/1000, st.Joined)
	require.Equal(t, n-n/1000, s.Leases()[0].Requests)
}

func TestEmitErrorsStopTheJoin(t *testing.T) {
	t.Parallel()
	stop := errors.New("stop")
	_, err := auditjoin.Join(strings.NewReader(apiLog), index(t), auditjoin.Filter{}, func(auditjoin.Row) error { return stop })
	require.ErrorIs(t, err, stop)
}

func FuzzParseAPIEvent(f *testing.F) {
	for _, line := range strings.Split(apiLog, "\n") {
		f.Add([]byte(line))
	}
	f.Fuzz(func(t *testing.T, line []byte) {
		ev, err := auditjoin.ParseAPIEvent(line)
		if err != nil {
			return
		}
		for _, s := range []string{ev.AuditID, ev.Verb, ev.Username, ev.CredentialID, ev.Resource, ev.Namespace, ev.Name, ev.Path} {
			if len(s) > 1024 {
				t.Fatalf("a field of %d bytes was kept", len(s))
			}
		}
		if len(ev.Groups) > 64 {
			t.Fatalf("%d groups were kept", len(ev.Groups))
		}
	})
}

func FuzzParseBrokerEvent(f *testing.F) {
	for _, line := range strings.Split(brokerLog, "\n") {
		f.Add([]byte(line))
	}
	for _, action := range []string{"gateway_forward", "gateway_upgrade", "gateway_request"} {
		f.Add([]byte(`{"time":"2030-01-01T10:01:00Z","audit":"tokenbroker.io/v1","action":"` + action + `","decision":"allow","lease_id":"` + tokenLease + `","method":"GET","path":"/api/v1/pods","status":101,"api_audit_id":"5b0d6c1e-0000-4000-8000-000000000001"}`))
	}
	f.Fuzz(func(t *testing.T, line []byte) {
		ev, err := auditjoin.ParseBrokerEvent(line)
		if err != nil {
			return
		}
		if ev.Audit != audit.Schema {
			t.Fatalf("accepted an event of schema %q", ev.Audit)
		}
		idx := auditjoin.NewIndex(auditjoin.WithMaxGatewayRequests(1))
		idx.AddBrokerEvent(ev) // never panics
		ev.APIAuditID += "x"
		idx.AddBrokerEvent(ev) // nor past the limit
		if g := idx.Gateway(); g.Requests > 1 || g.Open > g.Requests || g.NotIndexed > g.NotIndexedEvents {
			t.Fatalf("gateway counts out of bounds: %+v", g)
		}
	})
}

func joinAll(t *testing.T, idx *auditjoin.Index, log string) ([]auditjoin.Row, auditjoin.Stats) {
	t.Helper()
	var rows []auditjoin.Row
	st, err := auditjoin.Join(strings.NewReader(log), idx, auditjoin.Filter{}, func(r auditjoin.Row) error {
		rows = append(rows, r)
		return nil
	})
	require.NoError(t, err)
	return rows, st
}

func TestAForgedLeaseSecretNeverOverridesTheBrokersIssueEvent(t *testing.T) {
	t.Parallel()
	idx := index(t)
	// A tenant forges a Secret with another lease id that names the token
	// lease's credential id, and one with the token lease's id that names
	// another credential: both are refused.
	idx.AddLease(auditjoin.Lease{ID: "ffffffffffffffffffffffffff", Peer: "east", Namespace: "argo", ServiceAccount: "runner", Credential: "token", CredentialID: tokenCred})
	idx.AddLease(auditjoin.Lease{ID: certLease, Peer: "east", Namespace: "argo", User: certUser, Credential: "clientCertificate", CredentialID: "X509SHA256=forged"})
	n, notes := idx.Conflicts()
	require.Equal(t, 2, n)
	require.Len(t, notes, 2)
	rows, st := joinAll(t, idx, apiLog)
	require.Len(t, rows, 5)
	for _, r := range rows {
		require.NotEqual(t, "east", r.Lease.Peer, "the forged Secret's peer is never blamed")
		require.Equal(t, auditjoin.SourceBrokerLog, r.Lease.Source)
		require.True(t, r.Lease.Disputed, "a lease someone else claims is marked")
	}
	require.Equal(t, 5, st.Disputed)
	require.Zero(t, st.FromSecret)
}

func TestBetweenLeaseSecretsTheEarliestCreatedWins(t *testing.T) {
	t.Parallel()
	for _, order := range []string{"real first", "forged first"} {
		idx := auditjoin.NewIndex()
		real := auditjoin.Lease{ID: tokenLease, Peer: "west", Namespace: "argo", ServiceAccount: "runner", Credential: "token", CredentialID: tokenCred, IssuedAt: at(0)}
		forged := auditjoin.Lease{ID: "ffffffffffffffffffffffffff", Peer: "east", Namespace: "argo", ServiceAccount: "runner", Credential: "token", CredentialID: tokenCred, IssuedAt: at(1)}
		if order == "real first" {
			idx.AddLease(real)
			idx.AddLease(forged)
		} else {
			idx.AddLease(forged)
			idx.AddLease(real)
		}
		n, _ := idx.Conflicts()
		require.Equal(t, 1, n, order)
		rows, st := joinAll(t, idx, apiLog)
		require.Len(t, rows, 3, order)
		require.Equal(t, tokenLease, rows[0].Lease.ID, order)
		require.Equal(t, auditjoin.SourceSecret, rows[0].Lease.Source)
		require.True(t, rows[0].Lease.Disputed)
		require.Equal(t, 3, st.FromSecret)
	}
}

func TestARequestWhoseUserIsNotTheLeasesSubjectIsNotJoined(t *testing.T) {
	t.Parallel()
	log := strings.Join([]string{
		apiEvent(at(1), "ResponseComplete", "get", "system:serviceaccount:kube-system:admin", tokenCred, "secrets", "kube-system", 200),
		apiEvent(at(2), "ResponseComplete", "get", "someone", certCred, "secrets", "kube-system", 200),
		apiEvent(at(3), "ResponseComplete", "get", saUser, tokenCred, "configmaps", "argo", 200),
	}, "\n") + "\n"
	rows, st := joinAll(t, index(t), log)
	require.Len(t, rows, 1)
	require.Equal(t, saUser, rows[0].Username)
	require.Equal(t, 2, st.WrongUser)
	require.Equal(t, 1, st.Joined)
}

func TestADuplicatedEventIsCountedOnce(t *testing.T) {
	t.Parallel()
	ev := apiEvent(at(1), "ResponseComplete", "get", saUser, tokenCred, "configmaps", "argo", 200)
	rows, st := joinAll(t, index(t), ev+"\n"+ev+"\n")
	require.Len(t, rows, 1)
	require.Equal(t, 1, st.Duplicates)
}

func TestRequestsSharingAClientChosenAuditIDAreEachCounted(t *testing.T) {
	t.Parallel()
	// A client sets its requests' audit ids (the Audit-ID header): one id
	// on every request must not make the join skip all but the first.
	var lines []string
	for i := range 3 {
		ev := apiEvent(at(i+1), "ResponseComplete", "delete", saUser, tokenCred, "configmaps", "argo", 200)
		lines = append(lines, regexp.MustCompile(`"auditID":"[^"]*"`).ReplaceAllString(ev, `"auditID":"chosen"`))
	}
	rows, st := joinAll(t, index(t), strings.Join(lines, "\n")+"\n")
	require.Len(t, rows, 3)
	require.Zero(t, st.Duplicates)
}

func TestImpersonatingRequestsUseOnlyTheRightToImpersonate(t *testing.T) {
	t.Parallel()
	line := `{"kind":"Event","apiVersion":"audit.k8s.io/v1","auditID":"imp","stage":"ResponseComplete","verb":"delete","requestURI":"/api/v1/namespaces/argo/secrets/x",` +
		`"user":{"username":"` + saUser + `","extra":{"` + auditjoin.CredentialIDKey + `":["` + tokenCred + `"]}},"impersonatedUser":{"username":"system:admin"},` +
		`"objectRef":{"resource":"secrets","namespace":"argo","name":"x"},"responseStatus":{"code":200},"requestReceivedTimestamp":"2030-01-01T10:01:00Z"}`
	rows, _ := joinAll(t, index(t), line+"\n")
	require.Len(t, rows, 1)
	require.Equal(t, "system:admin", rows[0].ImpersonatedUser)
	s := auditjoin.NewSummary()
	s.Add(rows[0])
	uses := s.Leases()[0].Uses
	require.Equal(t, []auditjoin.Use{{Permission: auditjoin.Permission{Verb: "impersonate", Resource: "users"}, Count: 1}}, uses,
		"the delete was authorized as system:admin, not as the lease's subject")

	rules := []rbacv1.PolicyRule{
		{Verbs: []string{"delete"}, APIGroups: []string{""}, Resources: []string{"secrets"}},
		{Verbs: []string{"impersonate"}, APIGroups: []string{""}, Resources: []string{"users", "groups"}},
		{Verbs: []string{"bind", "escalate"}, APIGroups: []string{"rbac.authorization.k8s.io"}, Resources: []string{"roles"}},
		{Verbs: []string{"create"}, APIGroups: []string{""}, Resources: []string{"pods/exec"}},
	}
	unused, unobservable := auditjoin.Unused(rules, uses)
	require.Equal(t, []auditjoin.Permission{{Verb: "delete", Resource: "secrets"}}, unused)
	require.Equal(t, []auditjoin.Permission{{Verb: "impersonate", Resource: "groups"}, {Verb: "create", Resource: "pods/exec"},
		{Verb: "bind", Group: "rbac.authorization.k8s.io", Resource: "roles"}, {Verb: "escalate", Group: "rbac.authorization.k8s.io", Resource: "roles"}}, unobservable,
		"verbs the audit log never shows are not called unused")
}

func TestTheAuthorizersDecisionSaysWhetherARequestWasDenied(t *testing.T) {
	t.Parallel()
	row := func(code int, decision string) auditjoin.Row {
		return auditjoin.Row{Verb: "get", Resource: "configmaps", Code: code, Decision: decision, Lease: auditjoin.Lease{ID: tokenLease, Namespace: "argo", ServiceAccount: "runner"}}
	}
	s := auditjoin.NewSummary()
	s.Add(row(403, "allow")) // allowed by RBAC, refused by an admission webhook
	s.Add(row(403, "forbid"))
	s.Add(row(403, ""))
	s.Add(row(200, "allow"))
	require.Equal(t, 2, s.Leases()[0].Uses[0].Denied)

	line := `{"kind":"Event","apiVersion":"audit.k8s.io/v1","stage":"ResponseComplete","verb":"get","annotations":{"authorization.k8s.io/decision":"allow","authorization.k8s.io/reason":""},"responseStatus":{"code":403}}`
	ev, err := auditjoin.ParseAPIEvent([]byte(line))
	require.NoError(t, err)
	require.Equal(t, "allow", ev.Decision)
}

func TestTheSummaryKeepsABoundedNumberOfPermissions(t *testing.T) {
	t.Parallel()
	s := auditjoin.NewSummary()
	l := auditjoin.Lease{ID: tokenLease, Namespace: "argo", ServiceAccount: "runner"}
	for i := range auditjoin.MaxPermissions + 10 {
		s.Add(auditjoin.Row{Verb: "get", Path: fmt.Sprintf("/x/%d", i), Code: 404, Lease: l})
	}
	s.Add(auditjoin.Row{Verb: "get", Path: "/x/1", Code: 200, Lease: l})
	lu := s.Leases()[0]
	require.Len(t, lu.Uses, auditjoin.MaxPermissions)
	require.Equal(t, 10, lu.OtherRequests)
	require.Equal(t, auditjoin.MaxPermissions+11, lu.Requests)
	su := s.Subjects()[0]
	require.Len(t, su.Uses, auditjoin.MaxPermissions)
	require.Equal(t, 10, su.OtherRequests)
	require.Equal(t, 10, s.Overflow())
}

func TestARoleBindingsRulesAreUsedOnlyInItsNamespace(t *testing.T) {
	t.Parallel()
	s := auditjoin.NewSummary()
	l := auditjoin.Lease{ID: tokenLease, Namespace: "argo", ServiceAccount: "runner"}
	s.Add(auditjoin.Row{Verb: "list", Resource: "configmaps", Namespace: "other", Code: 200, Lease: l})
	s.Add(auditjoin.Row{Verb: "get", Resource: "configmaps", Namespace: "argo", Code: 403, Lease: l})
	uses := s.Subjects()[0].Uses
	rules := []rbacv1.PolicyRule{{Verbs: []string{"get", "list"}, APIGroups: []string{""}, Resources: []string{"configmaps"}}}
	unused, _ := auditjoin.UnusedIn("argo", rules, uses)
	require.Equal(t, []auditjoin.Permission{{Verb: "get", Resource: "configmaps", Namespace: "argo"}, {Verb: "list", Resource: "configmaps", Namespace: "argo"}}, unused,
		"a list in another namespace does not use argo's RoleBinding; a refused get uses nothing")
	require.Equal(t, "list configmaps in argo", unused[1].String())
	unused, _ = auditjoin.UnusedIn("other", rules, uses)
	require.Equal(t, []auditjoin.Permission{{Verb: "get", Resource: "configmaps", Namespace: "other"}}, unused)
	unused, _ = auditjoin.Unused(rules, uses)
	require.Equal(t, []auditjoin.Permission{{Verb: "get", Resource: "configmaps"}}, unused, "a ClusterRoleBinding's rules are used in any namespace")
}
