package lease

import (
	"bytes"
	"encoding/base64"
	"errors"
	"strings"

	"k8s.io/apimachinery/pkg/util/validation"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/broker/problem"
)

// Paging of GET /v1/leases. A peer's leases live in several namespaces and
// the API server pages each namespace's list on its own, so the broker's
// continue token says where to resume: the namespace and the API server's
// continue token inside it. The broker lists one namespace at a time with
// the API server's Limit/Continue and never holds more than one page.
const (
	// DefaultLeasePageSize is the page size of GET /v1/leases without a
	// limit; a caller that ignores continue gets this many at most.
	DefaultLeasePageSize = 500
	// MaxLeasePageSize bounds limit.
	MaxLeasePageSize = 1000
	// MaxLeaseContinueBytes bounds a continue token as the caller sends it.
	// The API server's own tokens are a few hundred bytes.
	MaxLeaseContinueBytes = 4096
	// leaseContinueVersion starts every decoded token, so that a future
	// format can refuse an old one with a clear 400.
	leaseContinueVersion = "l1"
)

// leaseCursor is where the next page of a lease listing starts: in
// Namespace (the first namespace of the peer's sorted list that is not
// before it), at the API server's continue token APIContinue ("" for the
// namespace's beginning).
//
// The namespace is named, not numbered, so that a namespace added to or
// removed from the peer's grants between two pages neither repeats nor
// skips the leases of the others.
type Cursor struct {
	Namespace   string
	APIContinue string
}

// errBadContinue is every refusal of a continue token; its detail never
// says more to the caller than that the token is not one of ours.
var errBadContinue = errors.New("not a continue token of GET /v1/leases")

// encodeLeaseContinue is the opaque token of cur: base64url (unpadded) of
// the version, the namespace and the API server's token, separated by
// newlines (which none of them contains).
func EncodeContinue(cur Cursor) string {
	raw := leaseContinueVersion + "\n" + cur.Namespace + "\n" + cur.APIContinue
	return base64.RawURLEncoding.EncodeToString([]byte(raw))
}

// decodeLeaseContinue parses a continue token from a caller (untrusted):
// bounded in size, strict base64url, our version, a namespace name that is
// a valid DNS label, and an API server token made only of the characters
// the API server's own tokens use. Anything else is errBadContinue. The API
// server still checks its own token; a forged one gets a 400 there too.
func decodeLeaseContinue(token string) (Cursor, error) {
	// The decoder skips CR and LF even when strict: refuse them, so that a
	// token is accepted in its one canonical form only.
	if token == "" || len(token) > MaxLeaseContinueBytes || strings.ContainsAny(token, "\r\n") {
		return Cursor{}, errBadContinue
	}
	raw, err := base64.RawURLEncoding.Strict().DecodeString(token)
	if err != nil {
		return Cursor{}, errBadContinue
	}
	parts := bytes.Split(raw, []byte("\n"))
	if len(parts) != 3 || string(parts[0]) != leaseContinueVersion {
		return Cursor{}, errBadContinue
	}
	cur := Cursor{Namespace: string(parts[1]), APIContinue: string(parts[2])}
	if len(validation.IsDNS1123Label(cur.Namespace)) > 0 {
		return Cursor{}, errBadContinue
	}
	if strings.IndexFunc(cur.APIContinue, func(r rune) bool { return !isAPIContinueChar(r) }) >= 0 {
		return Cursor{}, errBadContinue
	}
	return cur, nil
}

// isAPIContinueChar reports whether r may appear in the API server's
// continue token (base64, either alphabet, with padding).
func isAPIContinueChar(r rune) bool {
	return r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' ||
		r == '-' || r == '_' || r == '+' || r == '/' || r == '='
}

// PageRequest is what GET /v1/leases asks for: at most Limit leases
// (0 means DefaultLeasePageSize), from Continue ("" for the first page).
type PageRequest struct {
	Limit    int
	Continue string
}

// Validate checks the request as the caller sent it: a KindInvalid error
// with field paths (400), or nil.
func (r PageRequest) Validate() error {
	_, _, err := r.Parse()
	return err
}

// parse is Validate, also returning where to start and the page size.
func (r PageRequest) Parse() (Cursor, int, error) {
	var fields []apiv1.FieldError
	limit := r.Limit
	switch {
	case limit == 0:
		limit = DefaultLeasePageSize
	case limit < 0 || limit > MaxLeasePageSize:
		fields = append(fields, apiv1.FieldError{Field: "limit", Detail: "must be between 1 and 1000"})
	}
	var cur Cursor
	if r.Continue != "" {
		var err error
		if cur, err = decodeLeaseContinue(r.Continue); err != nil {
			fields = append(fields, apiv1.FieldError{Field: "continue", Detail: "is not a continue token of this API; start again without it"})
		}
	}
	if len(fields) > 0 {
		return Cursor{}, 0, problem.Invalid(fields...)
	}
	return cur, limit, nil
}
