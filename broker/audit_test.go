package broker

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"
	apierrors "k8s.io/apimachinery/pkg/api/errors"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/broker/audit"
	"github.com/tokenbroker/tokenbroker/broker/metrics"
	"github.com/tokenbroker/tokenbroker/broker/policy"
	"github.com/tokenbroker/tokenbroker/broker/problem"
)

// auditRecorder keeps the events it is given, as JSON lines too, so tests
// can look at both.
type auditRecorder struct {
	mu     sync.Mutex
	events []audit.Event
	buf    bytes.Buffer
	log    *audit.Log
}

func newAuditRecorder() *auditRecorder {
	r := &auditRecorder{}
	r.log = audit.NewLog(&r.buf)
	return r
}

func (r *auditRecorder) Audit(ev audit.Event) error {
	r.mu.Lock()
	r.events = append(r.events, ev)
	r.mu.Unlock()
	return r.log.Audit(ev)
}

func (r *auditRecorder) all() []audit.Event {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]audit.Event(nil), r.events...)
}

func TestEveryKubeconfigDecisionIsAuditedOnceWithWhoAndWhat(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	rec := newAuditRecorder()
	e.b.cfg.Auditor = rec
	caller := Caller{Identity: west.Identity, CertSHA256: "sha256:abcd"}
	ctx := audit.WithRequestID(context.Background(), "req-1")

	resp, err := e.b.IssueKubeconfig(ctx, caller, apiv1.KubeconfigRequest{Namespace: "argo", ServiceAccount: "admiralty-source", TTL: "48h"})
	require.NoError(t, err)
	_, err = e.b.IssueKubeconfig(audit.WithRequestID(context.Background(), "req-2"), caller, apiv1.KubeconfigRequest{Namespace: "kube-system", ServiceAccount: "admin"})
	require.Equal(t, problem.KindForbidden, problem.KindOf(err))
	_, err = e.b.IssueKubeconfig(context.Background(), caller, apiv1.KubeconfigRequest{Namespace: "argo", ServiceAccount: "admiralty-source", MinTTL: "13h"})
	require.Equal(t, problem.KindUnprocessable, problem.KindOf(err))
	require.NoError(t, e.b.RevokeLease(audit.WithRequestID(context.Background(), "req-4"), caller, resp.LeaseID))
	require.Equal(t, problem.KindNotFound, problem.KindOf(e.b.RevokeLease(context.Background(), caller, resp.LeaseID)))
	e.iss.err = apierrors.NewServiceUnavailable("etcd is down")
	_, err = e.b.IssueKubeconfig(context.Background(), caller, apiv1.KubeconfigRequest{Namespace: "argo", ServiceAccount: "admiralty-source"})
	require.Equal(t, problem.KindUnavailable, problem.KindOf(err))

	evs := rec.all()
	require.Len(t, evs, 6, "one event per decision")
	for _, ev := range evs {
		require.Equal(t, audit.Schema, ev.Audit)
		require.False(t, ev.Time.IsZero())
		require.Equal(t, west.Identity, ev.Identity)
		require.Equal(t, "sha256:abcd", ev.CertSHA256)
	}

	allow := evs[0]
	require.Equal(t, audit.ActionIssue, allow.Action)
	require.Equal(t, audit.DecisionAllow, allow.Decision)
	require.Equal(t, "req-1", allow.RequestID)
	require.Equal(t, "west", allow.Peer)
	require.Equal(t, "argo", allow.Namespace)
	require.Equal(t, "admiralty-source", allow.ServiceAccount)
	require.Equal(t, apiv1.CredentialToken, allow.Credential)
	require.Equal(t, resp.LeaseID, allow.LeaseID)
	require.Equal(t, "jti-42", allow.TokenJTI, "the token's jti joins the API server's audit log")
	require.Equal(t, "JTI=jti-42", allow.CredentialID, "the id the API server logs for the token")
	require.Equal(t, "48h", allow.RequestedTTL)
	require.Equal(t, "12h0m0s", allow.GrantedTTL)
	require.Equal(t, policy.ClampedByGrant, allow.ClampedBy)
	require.NotEmpty(t, allow.ExpiresAt)

	require.Equal(t, audit.DecisionDeny, evs[1].Decision)
	require.Equal(t, "req-2", evs[1].RequestID)
	require.Equal(t, "no grant allows this request", evs[1].Reason)
	require.Empty(t, evs[1].LeaseID, "nothing was created")

	require.Equal(t, audit.DecisionDeny, evs[2].Decision)
	require.Contains(t, evs[2].Reason, "minTTL 13h0m0s cannot be granted")

	revoke := evs[3]
	require.Equal(t, audit.ActionRevoke, revoke.Action)
	require.Equal(t, audit.DecisionAllow, revoke.Decision)
	require.Equal(t, "req-4", revoke.RequestID)
	require.Equal(t, resp.LeaseID, revoke.LeaseID)
	require.Equal(t, "west", revoke.Peer)
	require.Equal(t, "argo", revoke.Namespace)
	require.Equal(t, "admiralty-source", revoke.ServiceAccount)

	require.Equal(t, audit.ActionRevoke, evs[4].Action)
	require.Equal(t, audit.DecisionDeny, evs[4].Decision)

	require.Equal(t, audit.DecisionError, evs[5].Decision)
	require.Equal(t, "the Kubernetes API server is unavailable", evs[5].Reason)

	requireNoSecret(t, rec.buf.String())
	lines := 0
	sc := bufio.NewScanner(bytes.NewReader(rec.buf.Bytes()))
	for sc.Scan() {
		var ev map[string]any
		require.NoError(t, json.Unmarshal(sc.Bytes(), &ev), sc.Text())
		require.Equal(t, audit.Schema, ev["audit"])
		lines++
	}
	require.Equal(t, 6, lines)
}

// requireNoSecret fails if s holds the fake issuer's token or any part of it
// but the payload (whose jti is meant to be there).
func requireNoSecret(t *testing.T, s string) {
	t.Helper()
	parts := strings.Split(secretToken, ".")
	require.NotContains(t, s, parts[2], "the token's signature is in the audit log")
	require.NotContains(t, s, parts[0]+"."+parts[1], "the token is in the audit log")
}

func TestAnInvalidLeaseIDIsNotCopiedIntoTheAuditLog(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	rec := newAuditRecorder()
	e.b.cfg.Auditor = rec
	require.Equal(t, problem.KindNotFound, problem.KindOf(e.b.RevokeLease(context.Background(), west, "../../etc/passwd\n{\"audit\":1}")))
	evs := rec.all()
	require.Len(t, evs, 1)
	require.Equal(t, audit.DecisionDeny, evs[0].Decision)
	require.Empty(t, evs[0].LeaseID)
}

func TestCertificateDecisionsAreAudited(t *testing.T) {
	t.Parallel()
	e := newCertEnv(t, testPolicy)
	rec := newAuditRecorder()
	e.b.cfg.Auditor = rec
	reg := prometheus.NewRegistry()
	m, err := metrics.New(reg)
	require.NoError(t, err)
	e.b.cfg.Metrics = m
	ctx := audit.WithRequestID(context.Background(), "enroll-1")

	tok, claims := e.joinToken(t, westID)
	resp, err := e.b.Enroll(ctx, tok, apiv1.CertificateRequest{CSR: newCSR(t, westID)})
	require.NoError(t, err)
	_, err = e.b.Enroll(ctx, tok, apiv1.CertificateRequest{CSR: newCSR(t, westID)})
	requireUniformUnauthenticated(t, err)
	_, err = e.b.Enroll(ctx, "not-a-token", apiv1.CertificateRequest{CSR: newCSR(t, westID)})
	requireUniformUnauthenticated(t, err)
	caller := callerFrom(t, e.ca, westID)
	caller.CertSHA256 = "sha256:beef"
	renewed, err := e.b.Renew(ctx, caller, apiv1.CertificateRequest{CSR: newCSR(t, westID)})
	require.NoError(t, err)
	_, err = e.b.Renew(ctx, caller, apiv1.CertificateRequest{CSR: newCSR(t, northID)})
	require.Equal(t, problem.KindForbidden, problem.KindOf(err))

	evs := rec.all()
	require.Len(t, evs, 5)
	enrolled := evs[0]
	require.Equal(t, audit.ActionEnroll, enrolled.Action)
	require.Equal(t, audit.DecisionAllow, enrolled.Decision)
	require.Equal(t, "enroll-1", enrolled.RequestID)
	require.Equal(t, westID, enrolled.Identity)
	require.Equal(t, claims.ID, enrolled.JoinTokenID)
	require.Equal(t, resp.SerialNumber, enrolled.Serial)
	require.NotEmpty(t, enrolled.NotAfter)

	replay := evs[1]
	require.Equal(t, audit.DecisionDeny, replay.Decision)
	require.Equal(t, "join token already used", replay.Reason, "the audit log tells what the caller is not told")
	require.Equal(t, claims.ID, replay.JoinTokenID, "a replay is traced to the token's first use")
	require.Contains(t, evs[2].Reason, "join token not valid")
	require.Empty(t, evs[2].Identity)

	require.Equal(t, audit.ActionRenew, evs[3].Action)
	require.Equal(t, audit.DecisionAllow, evs[3].Decision)
	require.Equal(t, renewed.SerialNumber, evs[3].Serial)
	require.Equal(t, "sha256:beef", evs[3].CertSHA256)
	require.Equal(t, audit.DecisionDeny, evs[4].Decision)

	require.NotContains(t, rec.buf.String(), tok, "the join token is in the audit log")
	require.Equal(t, 2.0, metricValue(t, reg, "tokenbroker_denials_total", "action", audit.ActionEnroll, "reason", audit.DenyJoinToken))
	require.Equal(t, 1.0, metricValue(t, reg, "tokenbroker_denials_total", "action", audit.ActionRenew, "reason", audit.DenyIdentityMismatch))
	require.Equal(t, 1.0, metricValue(t, reg, "tokenbroker_audit_events_total", "action", audit.ActionEnroll, "decision", audit.DecisionAllow))
	require.Equal(t, 2.0, metricValue(t, reg, "tokenbroker_audit_events_total", "action", audit.ActionEnroll, "decision", audit.DecisionDeny))
}

type failingAuditor struct{}

func (failingAuditor) Audit(audit.Event) error { return errors.New("disk full") }

func TestAnAuditWriteFailureIsCountedAndLoggedButTheDecisionStands(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	reg := prometheus.NewRegistry()
	m, err := metrics.New(reg)
	require.NoError(t, err)
	e.b.cfg.Metrics, e.b.cfg.Auditor = m, failingAuditor{}
	_, err = e.b.IssueKubeconfig(context.Background(), west, apiv1.KubeconfigRequest{Namespace: "argo", ServiceAccount: "admiralty-source"})
	require.NoError(t, err)
	require.Equal(t, 1.0, metricValue(t, reg, "tokenbroker_audit_write_errors_total"))
	require.Equal(t, 1, e.logs.FilterMessage("audit event not written").Len())
}

func TestTheAuditLogNeverInterleavesEvents(t *testing.T) {
	t.Parallel()
	var buf bytes.Buffer
	l := audit.NewLog(&buf)
	var wg sync.WaitGroup
	for i := range 50 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for j := range 20 {
				require.NoError(t, l.Audit(audit.Event{Audit: audit.Schema, Action: audit.ActionIssue, LeaseID: fmt.Sprintf("%d-%d", i, j), Reason: strings.Repeat("x", 500)}))
			}
		}()
	}
	wg.Wait()
	sc := bufio.NewScanner(&buf)
	sc.Buffer(nil, 1<<20)
	n := 0
	for sc.Scan() {
		var ev audit.Event
		require.NoError(t, json.Unmarshal(sc.Bytes(), &ev))
		n++
	}
	require.Equal(t, 1000, n)
}

// BenchmarkAuditLog is the cost an audit event adds to a request: one JSON
// encoding and one write.
func BenchmarkAuditLog(b *testing.B) {
	l := audit.NewLog(io.Discard)
	ev := audit.Event{
		Time: time.Now(), Audit: audit.Schema, Action: audit.ActionIssue, Decision: audit.DecisionAllow, RequestID: "8f3c0a9d2b7e4c1f",
		Identity: "spiffe://oc.example/cluster/west", Peer: "west", CertSHA256: "sha256:" + strings.Repeat("ab", 32),
		Namespace: "argo", ServiceAccount: "admiralty-source", Credential: "token", LeaseID: "q3fcxb7kumyz4pa2m6dxx5jnle",
		TokenJTI: "6a1c0a8e-1b1e-4bb4-9d7b-1d1e2f3a4b5c", RequestedTTL: "2h", GrantedTTL: "1h0m0s", ClampedBy: policy.ClampedByGrant,
		ExpiresAt: "2026-11-22T07:00:00Z",
	}
	b.ReportAllocs()
	for b.Loop() {
		if err := l.Audit(ev); err != nil {
			b.Fatal(err)
		}
	}
}

func TestARefusedCallerIsAuditedAndCounted(t *testing.T) {
	t.Parallel()
	e, reg, _ := newMetricsEnv(t)
	rec := newAuditRecorder()
	e.b.cfg.Auditor = rec
	e.b.RefuseCaller(audit.WithRequestID(context.Background(), "r-401"), Caller{Identity: westID, CertSHA256: "sha256:aa"}, audit.RefusedRevoked, "identity is revoked")
	evs := rec.all()
	require.Len(t, evs, 1)
	require.Equal(t, audit.Event{
		Time: evs[0].Time, Audit: audit.Schema, Action: audit.ActionAuthenticate, Decision: audit.DecisionDeny,
		Reason: "identity is revoked", RequestID: "r-401", Identity: westID, CertSHA256: "sha256:aa",
	}, evs[0])
	require.Equal(t, 1.0, metricValue(t, reg, "tokenbroker_denials_total", "action", audit.ActionAuthenticate, "reason", audit.RefusedRevoked))
}
