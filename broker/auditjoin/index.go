package auditjoin

import (
	"errors"
	"fmt"
	"io"
	"time"
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
}

// NewIndex returns an empty index.
func NewIndex() *Index {
	return &Index{byID: map[string]*Lease{}, byCred: map[string]*Lease{}}
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

// AddLease adds a lease read from its Secret. What the broker's issue
// event already said of it is kept (it also names the issuing request);
// the Secret adds its credential id if the event had none. A lease
// without a credential id is kept (a later event may name it) but joins
// nothing.
func (x *Index) AddLease(in Lease) {
	if in.ID == "" {
		return
	}
	l := x.lease(in.ID)
	if l.IssuedAt.IsZero() {
		revokedAt, reason := l.RevokedAt, l.RevokeReason
		*l = in
		if l.RevokedAt.IsZero() {
			l.RevokedAt, l.RevokeReason = revokedAt, reason
		}
	} else if l.CredentialID == "" {
		l.CredentialID = in.CredentialID
	}
	if l.CredentialID != "" {
		x.byCred[l.CredentialID] = l
	}
}

// AddBrokerEvent adds what a broker audit event says of a lease: an
// allowed issuance names the lease and its credential; an allowed
// revocation says when it ended. Other events are ignored.
func (x *Index) AddBrokerEvent(ev BrokerEvent) {
	if ev.LeaseID == "" || ev.Decision != "allow" {
		return
	}
	switch ev.Action {
	case "issue":
		l := x.lease(ev.LeaseID)
		l.Peer, l.Identity, l.Namespace, l.ServiceAccount = ev.Peer, ev.Identity, ev.Namespace, ev.ServiceAccount
		l.User, l.Workload, l.Credential, l.Grant = ev.User, ev.Workload, ev.Credential, ev.Grant
		l.IssuedAt, l.IssueRequestID = ev.Time, ev.RequestID
		if exp, err := time.Parse(time.RFC3339, ev.ExpiresAt); err == nil {
			l.ExpiresAt = exp.UTC()
		}
		if ev.CredentialID != "" {
			l.CredentialID = ev.CredentialID
			x.byCred[ev.CredentialID] = l
		}
	case "revoke":
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
