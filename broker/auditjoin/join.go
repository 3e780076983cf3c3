package auditjoin

import (
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"time"
)

// Filter selects the joined requests: by lease id, by peer, and from a
// time on (the request's receipt). Zero values select everything.
type Filter struct {
	LeaseID string
	Peer    string
	Since   time.Time
}

// Row is one API request made with a broker credential, joined to its
// lease.
type Row struct {
	Time        time.Time `json:"time"`
	AuditID     string    `json:"auditID,omitempty"`
	Verb        string    `json:"verb"`
	Group       string    `json:"group,omitempty"`
	Resource    string    `json:"resource,omitempty"`
	Subresource string    `json:"subresource,omitempty"`
	Namespace   string    `json:"namespace,omitempty"`
	Name        string    `json:"name,omitempty"`
	// Path is the URL path of a non-resource request (/api, /version).
	Path string `json:"path,omitempty"`
	Code int    `json:"code"`
	// Username is who the API server says made the request: always the
	// lease's subject (other requests are not joined).
	Username string `json:"username"`
	// ImpersonatedUser is the user the request impersonated: it was
	// authorized as that user.
	ImpersonatedUser string `json:"impersonatedUser,omitempty"`
	// Decision is the authorizer's decision (allow, forbid) when the
	// event has it.
	Decision string `json:"decision,omitempty"`
	// LeaseState is the lease's state when the request was received:
	// live, revoked or expired.
	LeaseState string `json:"leaseState"`
	Lease      Lease  `json:"lease"`
}

// Stats counts what Join saw of the API server's log.
type Stats struct {
	ReadStats
	// Requests are the events that end a request (stage ResponseComplete
	// or Panic, or a ResponseStarted refusal of authentication) in the
	// filter's time window.
	Requests int `json:"requests"`
	// Joined are the requests attributed to a lease (before the lease
	// and peer filters).
	Joined int `json:"joined"`
	// Unauthenticated are requests refused with 401 that carry no user
	// and so no credential id: a revoked token's requests among them.
	Unauthenticated int `json:"unauthenticated"`
	// NoLease are requests with a credential id the index does not know
	// (other clients, or leases whose issue event or Secret was not read).
	NoLease int `json:"noLease"`
	// WrongUser are requests whose credential id is a lease's but whose
	// user is not the lease's subject: not joined (a forged lease Secret,
	// or an authenticator that lets a client set user.extra).
	WrongUser int `json:"wrongUser"`
	// FromSecret are the joined requests whose lease is known only from
	// its Secret, not from the broker's audit events.
	FromSecret int `json:"fromSecret"`
	// Disputed are the joined requests whose lease is disputed.
	Disputed int `json:"disputed"`
	// Duplicates are events whose auditID was already seen (overlapping
	// log files), skipped.
	Duplicates int `json:"duplicates"`
	// Gateway are the joined requests a lease gateway forwarded, joined by
	// the audit id the broker's gateway events recorded (gateway_forward,
	// gateway_upgrade or gateway_request: one request however many of
	// them were read). GatewayOpen are those of them known only from the
	// start of their stream: no gateway_request was read for them (the
	// replica died mid-stream, or the broker's log ends before it did).
	Gateway     int `json:"gateway"`
	GatewayOpen int `json:"gatewayOpen"`
}

// maxSeenAuditIDs bounds the events remembered to skip duplicates: the
// last ones seen.
const maxSeenAuditIDs = 100_000

// seenIDs remembers the last maxSeenAuditIDs events, each by the SHA-256 of
// its whole line (3.2 MB for all of them). Not by auditID: a client chooses
// its requests' audit ids (the Audit-ID header), so a lease holder could
// give all its requests one id and have all but the first skipped; a line
// repeated by an overlapping file or an at-least-once log pipeline is the
// same to the byte, while two requests' lines never are (their timestamps
// and audit ids differ).
type seenIDs struct {
	set  map[[sha256.Size]byte]struct{}
	ring [][sha256.Size]byte
	next int
}

// add reports whether id was already among the ids remembered, and
// remembers it.
func (s *seenIDs) add(id [sha256.Size]byte) bool {
	if _, ok := s.set[id]; ok {
		return true
	}
	if s.set == nil {
		s.set = map[[sha256.Size]byte]struct{}{}
	}
	if len(s.ring) < maxSeenAuditIDs {
		s.ring = append(s.ring, id)
	} else {
		delete(s.set, s.ring[s.next])
		s.ring[s.next] = id
		s.next = (s.next + 1) % maxSeenAuditIDs
	}
	s.set[id] = struct{}{}
	return false
}

// Join reads the API server's audit log from r, one event at a time, and
// calls emit for every request made with a credential of idx that f
// selects, in the log's order. It holds one line at a time.
func Join(r io.Reader, idx *Index, f Filter, emit func(Row) error) (st Stats, err error) {
	lr := newLineReader(r, MaxLineBytes)
	defer func() { st.TooLong = lr.tooLong; st.Lines += lr.tooLong }()
	var seen seenIDs
	for {
		line, err := lr.next()
		if errors.Is(err, io.EOF) {
			return st, nil
		}
		if err != nil {
			return st, fmt.Errorf("read API server audit log: %w", err)
		}
		st.Lines++
		ev, err := ParseAPIEvent(line)
		if err != nil {
			st.Malformed++
			continue
		}
		st.Events++
		if !endsRequest(ev) || (!f.Since.IsZero() && ev.Time.Before(f.Since)) {
			continue
		}
		if seen.add(sha256.Sum256(line)) {
			st.Duplicates++
			continue
		}
		st.Requests++
		if ev.Username == "" {
			if ev.Code == 401 {
				st.Unauthenticated++
			}
			continue
		}
		l := idx.Lookup(ev.CredentialID)
		viaGateway, open := false, false
		if l == nil {
			// A lease gateway's request: its credential is the gateway's,
			// its audit id the one the gateway recorded.
			if l, open = idx.lookupAudit(ev.AuditID); l != nil {
				viaGateway = true
			}
		}
		if l == nil {
			if ev.CredentialID != "" {
				st.NoLease++
			}
			continue
		}
		if want := l.ExpectedUsername(); want == "" || ev.Username != want {
			st.WrongUser++
			continue
		}
		st.Joined++
		if viaGateway {
			st.Gateway++
			if open {
				st.GatewayOpen++
			}
		}
		if l.Source == SourceSecret {
			st.FromSecret++
		}
		if l.Disputed {
			st.Disputed++
		}
		if (f.LeaseID != "" && l.ID != f.LeaseID) || (f.Peer != "" && l.Peer != f.Peer) {
			continue
		}
		row := Row{
			Time: ev.Time, AuditID: ev.AuditID, Verb: ev.Verb,
			Group: ev.Group, Resource: ev.Resource, Subresource: ev.Subresource,
			Namespace: ev.Namespace, Name: ev.Name, Path: ev.Path, Code: ev.Code,
			Username: ev.Username, ImpersonatedUser: ev.ImpersonatedUser, Decision: ev.Decision, LeaseState: l.StateAt(ev.Time), Lease: *l,
		}
		if err := emit(row); err != nil {
			return st, err
		}
	}
}

// endsRequest reports whether ev is the one event of its request that
// counts: ResponseComplete or Panic; or the ResponseStarted event the API
// server writes, with no user, for a request that failed authentication.
// (A watch also has a ResponseStarted event, with a user: its
// ResponseComplete counts.)
func endsRequest(ev APIEvent) bool {
	switch ev.Stage {
	case "ResponseComplete", "Panic":
		return true
	case "ResponseStarted":
		return ev.Username == ""
	}
	return false
}
