package problem

import (
	"errors"
	"fmt"
	"time"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
)

// Kind classifies a failure by what the caller can do about it. The server
// turns a Kind into an HTTP status in exactly one place.
type Kind int

// The kinds of failure. The zero value is KindInternal so that an error
// nobody classified is never shown to a client as its own fault.
const (
	KindInternal             Kind = iota // a bug or an unexpected failure: 500
	KindInvalid                          // the request is malformed or invalid: 400
	KindUnauthenticated                  // no usable identity: 401
	KindForbidden                        // policy denies it: 403
	KindNotFound                         // no such thing, or not the caller's: 404
	KindTooLarge                         // body over the limit: 413
	KindUnsupportedMediaType             // wrong Content-Type: 415
	KindUnprocessable                    // well-formed, but cannot be granted as asked: 422
	KindUnavailable                      // the API server cannot be reached; retryable: 503
	KindTimeout                          // the cluster did not finish in time (a signer); retryable: 504
	KindTooManyRequests                  // over a limit of the policy; retryable after RetryAfter: 429
	// KindBadWorkloadToken: the request's workload token was refused. Its
	// Reason (a pki.Token* code) is shown to the caller: 401.
	KindBadWorkloadToken
	// KindBadPodCertificate: the caller's pod certificate is sound but
	// does not prove a workload here (the peer's policy accepts none, its
	// Pod is not live). Its Reason is shown to the caller: 401.
	KindBadPodCertificate
)

// Error is a classified failure. Detail and Fields are meant for the caller
// and must never hold a credential; Err is the cause, for the log only.
type Error struct {
	Kind   Kind
	Detail string
	// Reason is a caller-safe reason code, for KindBadWorkloadToken and
	// KindBadPodCertificate.
	Reason string
	Fields []apiv1.FieldError
	Err    error
	// RetryAfter, for KindTooManyRequests, is how long until the request
	// can succeed.
	RetryAfter time.Duration
}

func (e *Error) Error() string {
	switch {
	case e.Err != nil && e.Detail != "":
		return fmt.Sprintf("%s: %v", e.Detail, e.Err)
	case e.Err != nil:
		return e.Err.Error()
	default:
		return e.Detail
	}
}

func (e *Error) Unwrap() error { return e.Err }

// KindOf returns the Kind of the first *Error in err's chain, and
// KindInternal if there is none.
func KindOf(err error) Kind {
	var be *Error
	if errors.As(err, &be) {
		return be.Kind
	}
	return KindInternal
}

// Retryable reports whether the same request may succeed later unchanged.
func Retryable(err error) bool {
	k := KindOf(err)
	return k == KindUnavailable || k == KindTimeout || k == KindTooManyRequests
}

// RetryAfterOf is the RetryAfter of the first *Error in err's chain.
func RetryAfterOf(err error) time.Duration {
	var be *Error
	if errors.As(err, &be) {
		return be.RetryAfter
	}
	return 0
}

// Errorf returns an *Error of the given kind whose detail is the formatted
// message. The message is shown to the caller.
func Errorf(kind Kind, format string, args ...any) *Error {
	return &Error{Kind: kind, Detail: fmt.Sprintf(format, args...)}
}

// Invalid returns a KindInvalid error listing the invalid fields.
func Invalid(fields ...apiv1.FieldError) *Error {
	return &Error{Kind: KindInvalid, Detail: "the request is invalid", Fields: fields}
}

// Wrap classifies cause as kind with a caller-safe detail.
func Wrap(kind Kind, detail string, cause error) *Error {
	return &Error{Kind: kind, Detail: detail, Err: cause}
}

// Detail is what the caller is told of err: its Error's Detail, which
// never holds a secret, else err's text.
func Detail(err error) string {
	var be *Error
	if errors.As(err, &be) && be.Detail != "" {
		return be.Detail
	}
	return err.Error()
}

// Label is the metric label of err's kind in labels, else other.
func Label(err error, labels map[Kind]string, other string) string {
	if l, ok := labels[KindOf(err)]; ok {
		return l
	}
	return other
}
