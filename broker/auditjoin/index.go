package auditjoin

import (
	"errors"
	"fmt"
	"io"
	"time"

	"github.com/tokenbroker/tokenbroker/broker/audit"
)

// Lease is what the join knows of one lease: from the broker's issue
// event (or its lease Secret) and, if it was revoked, its revoke event.
type Lease struct {
	ID             string    `json:"id"`
	Peer           string    `json:"peer,omitempty"`
	Identity       string    `json:"identity,omitempty"`
	Namespace      string    `json:"namespace,omitempty"`
	ServiceAccount string    `json:"serviceAccount,omitempty"`
	User           string    `json:"user,omitempty"`
	Workload       string    `json:"workload,omitempty"`
	Credential     string    `json:"credential,omitempty"`
	Grant          string    `json:"grant,omitempty"`
	CredentialID   string    `json:"credentialId,omitempty"`
	IssuedAt       time.Time `json:"issuedAt,omitzero"`
	// IssueRequestID is the broker's request id of the issuance (its
	// X-Request-Id), "" when the lease comes from its Secret.
	IssueRequestID string    `json:"issueRequestId,omitempty"`
	ExpiresAt      time.Time `json:"expiresAt,omitzero"`
	RevokedAt      time.Time `json:"revokedAt,omitzero"`
	RevokeReason   string    `json:"revokeReason,omitempty"`
	// Source is where the lease is known from: SourceBrokerLog (the
	// broker's issue event, authoritative) or SourceSecret (only a lease
	// Secret, trusted as far as the lease admission policy protects them).
	Source string `json:"source"`
	// Disputed is set when another issue event or lease Secret claims the
	// same lease id or credential id with something else: one of them is
	// forged. The broker's event wins, then the earliest created Secret.
	Disputed bool `json:"disputed,omitempty"`

	fromIssue bool
}

// Lease sources.
const (
	SourceBrokerLog = "broker-log"
	SourceSecret    = "secret"
)

// ExpectedUsername is the user name the API server gives the lease's
// credential: system:serviceaccount:<namespace>:<name> for a token, the
// per-lease user for a certificate; "" when the lease does not say.
func (l *Lease) ExpectedUsername() string {
	s := l.Subject()
	if s.Name == "" || (s.Kind == SubjectServiceAccount && s.Namespace == "") {
		return ""
	}
	return s.String()
}

// Subject is the RBAC subject the lease's credential authenticates as:
// the ServiceAccount of a token, the per-lease user of a certificate.
func (l *Lease) Subject() Subject {
	if l.Credential == "clientCertificate" || l.User != "" {
		return Subject{Kind: SubjectUser, Name: l.User}
	}
	return Subject{Kind: SubjectServiceAccount, Namespace: l.Namespace, Name: l.ServiceAccount}
}

// StateAt is the lease's state at t: "revoked" from its revocation,
// "expired" from its expiry, else "live".
func (l *Lease) StateAt(t time.Time) string {
	switch {
	case !l.RevokedAt.IsZero() && !t.Before(l.RevokedAt):
		return "revoked"
	case !l.ExpiresAt.IsZero() && !t.Before(l.ExpiresAt):
		return "expired"
	}
	return "live"
}

// Index finds a lease by the credential id the API server logs.
type Index struct {
	byID   map[string]*Lease
	byCred map[string]*Lease
	// byAudit names the lease of each request a lease gateway forwarded,
	// by the Audit-ID it sent the API server: its gateway_forward and
	// gateway_upgrade events (written while the request runs) and its
	// gateway_request event (when it ends) name one request.
	byAudit map[string]gatewayRequest
	// maxGateway bounds byAudit; gateway counts what was (not) indexed.
	maxGateway int
	gateway    GatewayStats
	// skipped counts the gateway events not indexed by kind: forward,
	// upgrade, request.
	skipped [3]int
	// conflicts counts the claims refused; notes keeps the first few.
	conflicts int
	notes     []string
}

// maxConflictNotes bounds the conflicts described.
const maxConflictNotes = 20

func (x *Index) conflict(format string, args ...any) {
	x.conflicts++
	if len(x.notes) < maxConflictNotes {
		x.notes = append(x.notes, fmt.Sprintf(format, args...))
	}
}

// Conflicts returns how many claims of a lease id, a credential id or a
// gateway request's api_audit_id were refused because another source
// claimed it first or with more authority, and a description of the
// first few.
func (x *Index) Conflicts() (int, []string) { return x.conflicts, x.notes }

// gatewayRequest is what the index keeps of one request a lease gateway
// forwarded.
type gatewayRequest struct {
	lease string
	// ended is set once its gateway_request event is read: a request known
	// only from the start of its stream has not (the replica died, or the
	// log ends before the stream did).
	ended bool
}

// IndexOption configures an Index.
type IndexOption func(*Index)

// WithMaxGatewayRequests bounds the gateway requests the index remembers
// to n (DefaultMaxGatewayRequests without it; n < 1 is 1).
func WithMaxGatewayRequests(n int) IndexOption {
	return func(x *Index) { x.maxGateway = max(n, 1) }
}

// NewIndex returns an empty index.
func NewIndex(opts ...IndexOption) *Index {
	x := &Index{byID: map[string]*Lease{}, byCred: map[string]*Lease{}, byAudit: map[string]gatewayRequest{},
		maxGateway: DefaultMaxGatewayRequests}
	for _, o := range opts {
		o(x)
	}
	x.gateway.Limit = x.maxGateway
	return x
}

// DefaultMaxGatewayRequests is how many gateway requests an index
// remembers by default (about 150 bytes each: 300 MB at the limit). The
// events of requests past it are counted (GatewayStats), never dropped
// silently: their API server events cannot be joined.
const DefaultMaxGatewayRequests = 2_000_000

// MaxAuditIDBytes bounds an api_audit_id indexed: the gateway's are
// UUIDs (36 bytes). A gateway event with a longer one is counted
// (GatewayStats.BadAuditID), not indexed.
const MaxAuditIDBytes = 64

// GatewayStats counts the lease gateway's events an index read.
type GatewayStats struct {
	// Requests are the gateway requests indexed (one per api_audit_id,
	// however many of its events were read), Open those of them known only
	// from the start of their stream (gateway_forward or gateway_upgrade),
	// with no gateway_request read: the replica died, or the log ends
	// before the stream did.
	Requests int `json:"requests"`
	Open     int `json:"open"`
	// NotIndexedEvents are gateway events of requests not indexed because
	// the index held Limit requests already; NotIndexed is at least the
	// number of those requests (a stream has a gateway_forward, maybe a
	// gateway_upgrade and a gateway_request: the events of one kind, the
	// most numerous, each name another request). The API server's events
	// of those requests join nothing.
	NotIndexedEvents int `json:"notIndexedEvents"`
	NotIndexed       int `json:"notIndexed"`
	Limit            int `json:"limit"`
	// BadAuditID are gateway events whose api_audit_id is longer than
	// MaxAuditIDBytes: not the gateway's, not indexed.
	BadAuditID int `json:"badAuditID"`
}

// Gateway returns what the index read of the lease gateway's events.
func (x *Index) Gateway() GatewayStats { return x.gateway }

// LookupAudit returns the lease of the gateway request the API server
// logged under auditID, or nil. The gateway chose the id (a random UUID)
// and wrote it in the broker's own audit event, so a client cannot claim
// another lease's request; Join still requires the event's user to be
// the lease's.
func (x *Index) LookupAudit(auditID string) *Lease {
	l, _ := x.lookupAudit(auditID)
	return l
}

// lookupAudit is LookupAudit, and whether the request is known only from
// the start of its stream (no gateway_request read).
func (x *Index) lookupAudit(auditID string) (l *Lease, open bool) {
	r, ok := x.byAudit[auditID]
	if !ok {
		return nil, false
	}
	return x.byID[r.lease], !r.ended
}

// Len is the number of leases whose credential id is known.
func (x *Index) Len() int { return len(x.byCred) }

// Lookup returns the lease of a credential id, or nil.
func (x *Index) Lookup(credentialID string) *Lease { return x.byCred[credentialID] }

func (x *Index) lease(id string) *Lease {
	l := x.byID[id]
	if l == nil {
		l = &Lease{ID: id}
		x.byID[id] = l
	}
	return l
}

// AddLease adds a lease read from its Secret (Source SecretSource). A
// Secret never overrides the broker's issue event: what the event said is
// kept, the Secret only adds a credential id the event lacked, and a
// Secret that names another credential id for the lease, or a credential
// id another issued lease has, is refused, counted (Conflicts) and marks
// the lease disputed. Between Secrets, for the same lease id or credential
// id, the earliest created wins, as the broker's own lookup decides. A
// lease without a credential id is kept (a later event may name it) but
// joins nothing. Every field is bounded.
func (x *Index) AddLease(in Lease) {
	in = boundLease(in)
	if in.ID == "" {
		return
	}
	in.Source, in.fromIssue, in.Disputed = SourceSecret, false, false
	l := x.byID[in.ID]
	switch {
	case l == nil:
		l = &in
		x.byID[in.ID] = l
	case l.fromIssue:
		if in.CredentialID == "" || in.CredentialID == l.CredentialID {
			return
		}
		if l.CredentialID != "" {
			l.Disputed = true
			x.conflict("a lease Secret in namespace %q names credential id %q for lease %q, whose issue event names %q: the Secret is ignored",
				in.Namespace, in.CredentialID, in.ID, l.CredentialID)
			return
		}
		x.claim(l, in.CredentialID)
		return
	case l.Source == SourceSecret:
		// Two Secrets with one lease id: the earliest created wins.
		l.Disputed = true
		if !earlier(&in, l) {
			x.conflict("two lease Secrets claim lease %q (namespaces %q and %q): the earliest created is used", in.ID, l.Namespace, in.Namespace)
			return
		}
		x.conflict("two lease Secrets claim lease %q (namespaces %q and %q): the earliest created is used", in.ID, in.Namespace, l.Namespace)
		if x.byCred[l.CredentialID] == l {
			delete(x.byCred, l.CredentialID)
		}
		revokedAt, reason := l.RevokedAt, l.RevokeReason
		*l = in
		l.RevokedAt, l.RevokeReason, l.Disputed = revokedAt, reason, true
	default:
		// Known so far from a revoke event only.
		revokedAt, reason := l.RevokedAt, l.RevokeReason
		*l = in
		l.RevokedAt, l.RevokeReason = revokedAt, reason
	}
	if l.CredentialID != "" {
		x.claim(l, l.CredentialID)
	}
}

// earlier reports whether Secret lease a was created before b (by id on
// a tie, so that the order of reading does not decide).
func earlier(a, b *Lease) bool {
	if !a.IssuedAt.Equal(b.IssuedAt) {
		return a.IssuedAt.Before(b.IssuedAt)
	}
	return a.Namespace+"/"+a.ID < b.Namespace+"/"+b.ID
}

// claim maps credential id cred to l unless a lease with more authority
// has it: an issued lease over a Secret, the earliest created Secret over
// a later one.
func (x *Index) claim(l *Lease, cred string) {
	other := x.byCred[cred]
	switch {
	case other == nil || other == l:
	case other.fromIssue && l.fromIssue:
		other.Disputed, l.Disputed = true, true
		x.conflict("leases %q and %q are both issued with credential id %q: the first is used", other.ID, l.ID, cred)
		return
	case other.fromIssue:
		other.Disputed, l.Disputed = true, true
		x.conflict("a lease Secret (lease %q, namespace %q) names credential id %q of the issued lease %q: the Secret is ignored", l.ID, l.Namespace, cred, other.ID)
		return
	case l.fromIssue:
		other.Disputed, l.Disputed = true, true
		x.conflict("a lease Secret (lease %q, namespace %q) names credential id %q of the issued lease %q: the Secret is ignored", other.ID, other.Namespace, cred, l.ID)
	default:
		other.Disputed, l.Disputed = true, true
		if !earlier(l, other) {
			x.conflict("lease Secrets of leases %q and %q name credential id %q: the earliest created is used", other.ID, l.ID, cred)
			return
		}
		x.conflict("lease Secrets of leases %q and %q name credential id %q: the earliest created is used", l.ID, other.ID, cred)
	}
	l.CredentialID = cred
	x.byCred[cred] = l
}

// boundLease cuts every field of l to maxFieldBytes.
func boundLease(l Lease) Lease {
	for _, s := range []*string{&l.ID, &l.Peer, &l.Identity, &l.Namespace, &l.ServiceAccount, &l.User, &l.Workload,
		&l.Credential, &l.Grant, &l.CredentialID, &l.IssueRequestID, &l.RevokeReason} {
		*s = bound(*s)
	}
	return l
}

// AddBrokerEvent adds what a broker audit event says of a lease: an
// allowed issuance names the lease and its credential; an allowed
// revocation says when it ended; a lease gateway's event with an
// api_audit_id (gateway_forward and gateway_upgrade while a stream runs,
// gateway_request when a request ends) names the lease of the request the
// API server logged under that id. Other events are ignored.
func (x *Index) AddBrokerEvent(ev audit.Event) {
	if ev.LeaseID == "" {
		return
	}
	switch ev.Action {
	case audit.ActionGatewayForward, audit.ActionGatewayUpgrade, audit.ActionGatewayRequest:
		// Whatever its decision: an api_audit_id is there only if the
		// request was sent to the API server (a request that failed
		// upstream was still seen, and maybe logged, there).
		x.addGateway(ev)
		return
	}
	if ev.Decision != audit.DecisionAllow {
		return
	}
	switch ev.Action {
	case audit.ActionIssue:
		l := x.lease(ev.LeaseID)
		if l.fromIssue {
			// The same event read twice (a file given twice), or a
			// second issue of one lease id: the first stands.
			if ev.CredentialID != "" && l.CredentialID != "" && ev.CredentialID != l.CredentialID {
				l.Disputed = true
				x.conflict("two issue events for lease %q name credential ids %q and %q: the first is used", l.ID, l.CredentialID, ev.CredentialID)
			}
			return
		}
		if l.Source == SourceSecret {
			// Read from a Secret before its event: the event replaces it.
			if l.CredentialID != "" && ev.CredentialID != "" && l.CredentialID != ev.CredentialID {
				l.Disputed = true
				x.conflict("a lease Secret in namespace %q names credential id %q for lease %q, whose issue event names %q: the Secret is ignored",
					l.Namespace, l.CredentialID, l.ID, ev.CredentialID)
			}
			if l.CredentialID != "" && x.byCred[l.CredentialID] == l && l.CredentialID != ev.CredentialID && ev.CredentialID != "" {
				delete(x.byCred, l.CredentialID)
			}
			if ev.CredentialID == "" {
				ev.CredentialID = l.CredentialID
			}
		}
		l.fromIssue, l.Source = true, SourceBrokerLog
		l.Peer, l.Identity, l.Namespace, l.ServiceAccount = ev.Peer, ev.Identity, ev.Namespace, ev.ServiceAccount
		l.User, l.Workload, l.Credential, l.Grant = ev.User, ev.Workload, ev.Credential, ev.Grant
		l.IssuedAt, l.IssueRequestID = ev.Time, ev.RequestID
		if exp, err := time.Parse(time.RFC3339, ev.ExpiresAt); err == nil {
			l.ExpiresAt = exp.UTC()
		}
		if ev.CredentialID != "" {
			if x.byCred[l.CredentialID] == l && l.CredentialID != ev.CredentialID {
				delete(x.byCred, l.CredentialID)
			}
			l.CredentialID = ""
			x.claim(l, ev.CredentialID)
		}
	case audit.ActionRevoke:
		l := x.lease(ev.LeaseID)
		// The first revocation counts; a retried DELETE is not a new one.
		if l.RevokedAt.IsZero() || ev.Time.Before(l.RevokedAt) {
			l.RevokedAt, l.RevokeReason = ev.Time, ev.Reason
			if l.RevokeReason == "" {
				l.RevokeReason = "revoked by its peer"
			}
		}
		if l.Peer == "" {
			l.Peer, l.Identity, l.Namespace = ev.Peer, ev.Identity, ev.Namespace
		}
	}
}

// addGateway indexes one lease gateway event. The events of one request
// (its api_audit_id) are one request: the first names its lease, a later
// one naming another lease is a conflict, refused. Past maxGateway
// requests, a new request's events are counted, not indexed.
func (x *Index) addGateway(ev audit.Event) {
	id := ev.APIAuditID
	switch {
	case id == "":
		return
	case len(id) > MaxAuditIDBytes:
		x.gateway.BadAuditID++
		return
	}
	lid, ended := bound(ev.LeaseID), ev.Action == audit.ActionGatewayRequest
	if r, seen := x.byAudit[id]; seen {
		if r.lease != lid {
			// The gateway draws a random id per request: two leases with
			// one id is a forged or corrupted event.
			x.byID[r.lease].Disputed, x.lease(lid).Disputed = true, true
			x.conflict("gateway events name api_audit_id %q for leases %q and %q: the first is used", id, r.lease, lid)
			return
		}
		if ended && !r.ended {
			r.ended = true
			x.byAudit[id] = r
			x.gateway.Open--
		}
		return
	}
	if len(x.byAudit) >= x.maxGateway {
		g := &x.gateway
		g.NotIndexedEvents++
		k := 0
		switch ev.Action {
		case audit.ActionGatewayUpgrade:
			k = 1
		case audit.ActionGatewayRequest:
			k = 2
		}
		x.skipped[k]++
		g.NotIndexed = max(x.skipped[0], x.skipped[1], x.skipped[2])
		return
	}
	x.byAudit[id] = gatewayRequest{lease: x.lease(lid).ID, ended: ended}
	x.gateway.Requests++
	if !ended {
		x.gateway.Open++
	}
}

// ReadStats counts what a read saw.
type ReadStats struct {
	Lines int `json:"lines"`
	// Events are the lines that were events of the kind read.
	Events int `json:"events"`
	// TooLong are lines over MaxLineBytes, skipped.
	TooLong int `json:"tooLong"`
	// Malformed are lines that claimed to be events but did not decode.
	Malformed int `json:"malformed"`
}

// ReadBrokerLog adds the broker audit events of r (JSON lines, possibly
// interleaved with operational log lines, which are skipped) to the index.
func (x *Index) ReadBrokerLog(r io.Reader) (ReadStats, error) {
	var st ReadStats
	lr := newLineReader(r, MaxLineBytes)
	for {
		line, err := lr.next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			st.TooLong = lr.tooLong
			return st, fmt.Errorf("read broker audit log: %w", err)
		}
		st.Lines++
		ev, err := ParseBrokerEvent(line)
		switch {
		case errors.Is(err, ErrNotEvent):
			continue
		case err != nil:
			st.Malformed++
			continue
		}
		st.Events++
		x.AddBrokerEvent(ev)
	}
	st.TooLong = lr.tooLong
	st.Lines += lr.tooLong
	return st, nil
}
