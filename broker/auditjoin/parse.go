package auditjoin

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strings"
	"time"

	"github.com/tokenbroker/tokenbroker/broker/audit"
)

// MaxLineBytes bounds one line of either log. An API server's Metadata
// event is a few kilobytes; a line longer than this is skipped and counted.
const MaxLineBytes = 1 << 20

// CredentialIDKey is the user.extra key under which the API server names
// the credential of an authenticated request.
const CredentialIDKey = "authentication.kubernetes.io/credential-id"

// maxFieldBytes bounds every string kept from a parsed event: the index
// and the summary hold them for the whole run.
const maxFieldBytes = 1024

// ErrNotEvent marks a line that is well-formed JSON but not an event of
// the kind asked for (an operational log line among broker audit events).
var ErrNotEvent = errors.New("not an audit event")

// lineReader yields the lines of r, each at most max bytes without its
// newline; longer lines are skipped whole and counted in tooLong.
type lineReader struct {
	r       *bufio.Reader
	max     int
	buf     []byte
	tooLong int
}

func newLineReader(r io.Reader, max int) *lineReader {
	return &lineReader{r: bufio.NewReaderSize(r, 64<<10), max: max}
}

// next returns the next line (valid until the following call), or io.EOF.
func (l *lineReader) next() ([]byte, error) {
	for {
		l.buf = l.buf[:0]
		over := false
		var err error
		for {
			var chunk []byte
			chunk, err = l.r.ReadSlice('\n')
			if !over && len(l.buf)+len(chunk) <= l.max+2 { // +2: "\r\n"
				l.buf = append(l.buf, chunk...)
			} else {
				over, l.buf = true, l.buf[:0]
			}
			if !errors.Is(err, bufio.ErrBufferFull) {
				break
			}
		}
		if err != nil && !errors.Is(err, io.EOF) {
			return nil, err
		}
		if err != nil && !over && len(l.buf) == 0 {
			return nil, io.EOF
		}
		line := bytes.TrimRight(l.buf, "\r\n")
		if over || len(line) > l.max {
			l.tooLong++
			if err != nil {
				return nil, io.EOF
			}
			continue
		}
		return line, nil
	}
}

// APIEvent is what the join needs of an audit.k8s.io/v1 Event.
type APIEvent struct {
	AuditID string
	Stage   string
	// Time is when the request was received.
	Time time.Time
	Verb string
	// Username is "" for a request that failed authentication.
	Username     string
	Groups       []string
	CredentialID string
	// Group, Resource, Subresource, Namespace, Name are the objectRef's;
	// Resource is "" for a non-resource request (then Path is set).
	Group       string
	Resource    string
	Subresource string
	Namespace   string
	Name        string
	Path        string
	Code        int
	// ImpersonatedUser is the user name the request impersonated, "" if
	// none: the request was authorized as that user, not as Username.
	ImpersonatedUser string
	// Decision is the authorizer's, from the annotation
	// authorization.k8s.io/decision: "allow", "forbid", or "" if absent.
	Decision string
}

// DecisionAnnotation is the audit annotation with the authorizer's
// decision.
const DecisionAnnotation = "authorization.k8s.io/decision"

// apiEventJSON is the subset of audit.k8s.io/v1 Event that is decoded.
type apiEventJSON struct {
	Kind       string `json:"kind"`
	APIVersion string `json:"apiVersion"`
	AuditID    string `json:"auditID"`
	Stage      string `json:"stage"`
	RequestURI string `json:"requestURI"`
	Verb       string `json:"verb"`
	User       struct {
		Username string              `json:"username"`
		Groups   []string            `json:"groups"`
		Extra    map[string][]string `json:"extra"`
	} `json:"user"`
	ImpersonatedUser *struct {
		Username string `json:"username"`
	} `json:"impersonatedUser"`
	Annotations map[string]string `json:"annotations"`
	ObjectRef   *struct {
		Resource    string `json:"resource"`
		Namespace   string `json:"namespace"`
		Name        string `json:"name"`
		APIGroup    string `json:"apiGroup"`
		Subresource string `json:"subresource"`
	} `json:"objectRef"`
	ResponseStatus *struct {
		Code int `json:"code"`
	} `json:"responseStatus"`
	RequestReceivedTimestamp time.Time `json:"requestReceivedTimestamp"`
	StageTimestamp           time.Time `json:"stageTimestamp"`
}

// ParseAPIEvent decodes one line of an API server's JSON audit log. It
// refuses anything but an audit.k8s.io/v1 Event (ErrNotEvent), and keeps
// at most maxFieldBytes of each string.
func ParseAPIEvent(line []byte) (APIEvent, error) {
	var j apiEventJSON
	if err := json.Unmarshal(line, &j); err != nil {
		return APIEvent{}, fmt.Errorf("decode API server audit event: %w", err)
	}
	if j.Kind != "Event" || j.APIVersion != "audit.k8s.io/v1" {
		return APIEvent{}, ErrNotEvent
	}
	ev := APIEvent{
		AuditID:  bound(j.AuditID),
		Stage:    bound(j.Stage),
		Time:     j.RequestReceivedTimestamp.UTC(),
		Verb:     bound(j.Verb),
		Username: bound(j.User.Username),
	}
	if ev.Time.IsZero() {
		ev.Time = j.StageTimestamp.UTC()
	}
	const maxGroups = 64
	for i, g := range j.User.Groups {
		if i == maxGroups {
			break
		}
		ev.Groups = append(ev.Groups, bound(g))
	}
	if ids := j.User.Extra[CredentialIDKey]; len(ids) > 0 {
		ev.CredentialID = bound(ids[0])
	}
	if o := j.ObjectRef; o != nil && o.Resource != "" {
		ev.Group, ev.Resource, ev.Subresource = bound(o.APIGroup), bound(o.Resource), bound(o.Subresource)
		ev.Namespace, ev.Name = bound(o.Namespace), bound(o.Name)
	} else {
		path, _, _ := strings.Cut(j.RequestURI, "?")
		ev.Path = bound(path)
	}
	if j.ResponseStatus != nil {
		ev.Code = j.ResponseStatus.Code
	}
	if j.ImpersonatedUser != nil {
		ev.ImpersonatedUser = bound(j.ImpersonatedUser.Username)
	}
	switch d := j.Annotations[DecisionAnnotation]; d {
	case "allow", "forbid":
		ev.Decision = d
	}
	return ev, nil
}

// brokerMarker is in every broker audit event's line: a cheap test that
// skips the operational log lines interleaved with them.
var brokerMarker = []byte(`"audit":"` + audit.Schema + `"`)

// ParseBrokerEvent decodes one line of the broker's output. A line that is
// not a broker audit event (an operational log line, kubectl's own output)
// is ErrNotEvent; a line that claims to be one but does not decode is an
// error.
func ParseBrokerEvent(line []byte) (audit.Event, error) {
	if !bytes.Contains(line, brokerMarker) {
		return audit.Event{}, ErrNotEvent
	}
	var ev audit.Event
	if err := json.Unmarshal(line, &ev); err != nil {
		return audit.Event{}, fmt.Errorf("decode broker audit event: %w", err)
	}
	if ev.Audit != audit.Schema {
		return audit.Event{}, ErrNotEvent
	}
	for _, s := range []*string{&ev.Action, &ev.Decision, &ev.Reason, &ev.RequestID, &ev.Identity, &ev.Peer,
		&ev.Namespace, &ev.ServiceAccount, &ev.User, &ev.Credential, &ev.LeaseID, &ev.TokenJTI,
		&ev.CertificateSerial, &ev.CredentialID, &ev.ExpiresAt, &ev.Workload, &ev.Grant} {
		*s = bound(*s)
	}
	ev.Time = ev.Time.UTC()
	// Events written before credential_id existed name a token by its jti.
	if ev.CredentialID == "" && ev.TokenJTI != "" {
		ev.CredentialID = "JTI=" + ev.TokenJTI
	}
	return ev, nil
}

// bound cuts s to maxFieldBytes (on a byte boundary: the result is only
// ever compared and printed).
func bound(s string) string {
	if len(s) > maxFieldBytes {
		return s[:maxFieldBytes]
	}
	return s
}
