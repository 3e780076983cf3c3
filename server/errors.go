package server

import (
	"encoding/json"
	"errors"
	"math"
	"net/http"
	"strconv"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/broker/problem"
)

// problemTypePrefix starts the type URI of every problem.
const problemTypePrefix = "urn:tokenbroker:problem:"

// retryAfterSeconds is sent with 503 and 504 answers.
const retryAfterSeconds = "5"

// The 401 of the enrollment listener: one fixed detail for every failure
// of the join token, and the challenge RFC 6750 asks for.
const (
	enrollUnauthenticatedDetail = "A valid, unused join token is required as the bearer token."
	enrollAuthenticate          = `Bearer realm="tokenbroker-enrollment"`
	workloadAuthenticate        = `Bearer realm="tokenbroker", error="invalid_token"`
)

// Transport-level failures that have no broker.Kind. writeError maps them
// like the kinds.
var (
	errNotAcceptable    = errors.New("no acceptable media type")
	errMethodNotAllowed = errors.New("method not allowed")
	errRouteNotFound    = errors.New("no such route")
)

// problemClass is how one kind of failure is shown to the caller.
type problemClass struct {
	status int
	slug   string
	// fixed, when set, replaces any detail: the caller learns nothing of
	// the cause.
	fixed bool
	// detail is shown when the error brings none (or always, if fixed).
	detail string
}

var (
	classInvalid = problemClass{http.StatusBadRequest, "invalid-request", false,
		"The request is invalid."}
	classUnauthenticated = problemClass{http.StatusUnauthorized, "unauthenticated", true,
		"A valid client certificate with a SPIFFE identity is required."}
	classForbidden = problemClass{http.StatusForbidden, "forbidden", true,
		"The policy does not allow this request."}
	classNotFound = problemClass{http.StatusNotFound, "not-found", false,
		"The resource does not exist."}
	classMethodNotAllowed = problemClass{http.StatusMethodNotAllowed, "method-not-allowed", false,
		"The method is not allowed for this resource; see the Allow header."}
	classNotAcceptable = problemClass{http.StatusNotAcceptable, "not-acceptable", false,
		"None of the accepted media types can be produced; accept application/json or application/yaml."}
	classTooLarge = problemClass{http.StatusRequestEntityTooLarge, "payload-too-large", false,
		"The request body is too large."}
	classUnsupportedMediaType = problemClass{http.StatusUnsupportedMediaType, "unsupported-media-type", false,
		"The request body must be application/json."}
	classUnprocessable = problemClass{http.StatusUnprocessableEntity, "unprocessable", false,
		"The request cannot be granted as asked."}
	classUnavailable = problemClass{http.StatusServiceUnavailable, "unavailable", true,
		"The service is temporarily unavailable; retry later."}
	classTimeout = problemClass{http.StatusGatewayTimeout, "timeout", false,
		"The cluster did not finish in time; retry later."}
	classTooManyRequests = problemClass{http.StatusTooManyRequests, "too-many-requests", false,
		"Over a limit of the policy; retry after Retry-After seconds."}
	classBadWorkloadToken = problemClass{http.StatusUnauthorized, "invalid-workload-token", false,
		"The workload token was refused."}
	classBadPodCertificate = problemClass{http.StatusUnauthorized, "invalid-pod-certificate", false,
		"The pod certificate was refused."}
	classInternal = problemClass{http.StatusInternalServerError, "internal", true,
		"An internal error occurred; the request id identifies it in the server log."}
)

// kindClasses is the class of each Kind of the broker. A Kind not here
// (KindInternal, or one added to the broker later) is internal, so that
// it is never shown as the caller's fault.
var kindClasses = map[problem.Kind]problemClass{
	problem.KindInvalid:              classInvalid,
	problem.KindUnauthenticated:      classUnauthenticated,
	problem.KindForbidden:            classForbidden,
	problem.KindNotFound:             classNotFound,
	problem.KindTooLarge:             classTooLarge,
	problem.KindUnsupportedMediaType: classUnsupportedMediaType,
	problem.KindUnprocessable:        classUnprocessable,
	problem.KindUnavailable:          classUnavailable,
	problem.KindTimeout:              classTimeout,
	problem.KindTooManyRequests:      classTooManyRequests,
	problem.KindBadWorkloadToken:     classBadWorkloadToken,
	problem.KindBadPodCertificate:    classBadPodCertificate,
}

// classOf chooses the class of err: a transport failure's, or its
// broker Kind's (kindClasses).
func classOf(err error) (problemClass, *problem.Error) {
	switch {
	case errors.Is(err, errNotAcceptable):
		return classNotAcceptable, nil
	case errors.Is(err, errMethodNotAllowed):
		return classMethodNotAllowed, nil
	case errors.Is(err, errRouteNotFound):
		return classNotFound, nil
	}
	var be *problem.Error
	if !errors.As(err, &be) {
		return classInternal, nil
	}
	if class, ok := kindClasses[be.Kind]; ok {
		return class, be
	}
	return classInternal, be
}

// writeError is the one place where an error becomes an HTTP answer: an
// RFC 9457 problem+json whose status comes from the error's class. For
// 401, 403 and 5xx the detail is fixed; otherwise the broker.Error's Detail
// and Fields are shown. The error itself is logged with the request id.
func writeError(w http.ResponseWriter, r *http.Request, err error) {
	class, be := classOf(err)
	p := apiv1.Problem{
		Type:      problemTypePrefix + class.slug,
		Title:     http.StatusText(class.status),
		Status:    class.status,
		Detail:    class.detail,
		Instance:  r.URL.Path,
		RequestID: requestIDFrom(r.Context()),
	}
	if !class.fixed && be != nil {
		if be.Detail != "" {
			p.Detail = be.Detail
		}
		p.Errors = be.Fields
		if class == classBadWorkloadToken || class == classBadPodCertificate {
			p.Reason = be.Reason
		}
	}
	enrolling := listenerFrom(r.Context()) == listenerEnroll
	if class.status == http.StatusUnauthorized && enrolling {
		// The enrollment listener authenticates with a join token, not a
		// client certificate; the answer is as uniform as the other.
		p.Detail = enrollUnauthenticatedDetail
	}

	level := zapcore.DebugLevel
	switch {
	case class.status >= 500:
		level = zapcore.ErrorLevel
	case class.status == http.StatusUnauthorized || class.status == http.StatusForbidden:
		// Security-relevant refusals are worth seeing in a normal log.
		level = zapcore.InfoLevel
	}
	loggerFrom(r.Context()).Check(level, "request failed").Write(
		zap.Int("status", class.status),
		zap.String("problem", class.slug),
		zap.Error(err),
	)

	body, mErr := json.Marshal(p)
	if mErr != nil {
		// A Problem holds only strings and ints; this cannot happen.
		body = []byte(`{"type":"` + problemTypePrefix + `internal","title":"Internal Server Error","status":500}`)
	}
	h := w.Header()
	h.Set("Content-Type", apiv1.MediaTypeProblem)
	h.Set("Content-Length", strconv.Itoa(len(body)))
	retryAfter := problem.RetryAfterOf(err)
	switch {
	case class.status == http.StatusTooManyRequests,
		// The cause knows when (a Pod the peer has not reported yet).
		class.status == http.StatusServiceUnavailable && retryAfter > 0:
		h.Set("Retry-After", strconv.Itoa(max(1, int(math.Ceil(retryAfter.Seconds())))))
	case class.status == http.StatusServiceUnavailable || class.status == http.StatusGatewayTimeout:
		h.Set("Retry-After", retryAfterSeconds)
	}
	if class.status == http.StatusUnauthorized && enrolling {
		h.Set("WWW-Authenticate", enrollAuthenticate)
	}
	if class == classBadWorkloadToken {
		// RFC 6750 §3: the bearer token is the problem, not the certificate.
		h.Set("WWW-Authenticate", workloadAuthenticate)
	}
	w.WriteHeader(class.status)
	_, _ = w.Write(body) // the client has gone; nothing left to tell it
}

// writeJSON answers status with v as application/json. v is marshalled
// before anything is written, so a failure can still become a 500.
func writeJSON(w http.ResponseWriter, r *http.Request, status int, v any) {
	body, err := json.Marshal(v)
	if err != nil {
		writeError(w, r, err)
		return
	}
	h := w.Header()
	h.Set("Content-Type", apiv1.MediaTypeJSON)
	h.Set("Content-Length", strconv.Itoa(len(body)))
	w.WriteHeader(status)
	_, _ = w.Write(body) // the client has gone; nothing left to tell it
}
