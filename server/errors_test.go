package server

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"testing"

	"github.com/stretchr/testify/require"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/broker"
	"github.com/tokenbroker/tokenbroker/broker/problem"
)

func TestBrokerErrorsBecomeProblems(t *testing.T) {
	t.Parallel()
	const secret = "secret-detail-with-" + testToken
	fields := []apiv1.FieldError{{Field: "namespace", Detail: "is required"}}
	cause := errors.New("cause-" + testToken)

	tests := []struct {
		name       string
		err        error
		status     int
		slug       string
		detail     string
		fields     []apiv1.FieldError
		retryAfter string
	}{
		{
			name:   "An invalid error shows its detail and fields with 400.",
			err:    &problem.Error{Kind: problem.KindInvalid, Detail: "bad namespace", Fields: fields},
			status: http.StatusBadRequest, slug: "invalid-request", detail: "bad namespace", fields: fields,
		},
		{
			name:   "An invalid error without a detail gets the default detail.",
			err:    &problem.Error{Kind: problem.KindInvalid},
			status: http.StatusBadRequest, slug: "invalid-request", detail: "The request is invalid.",
		},
		{
			name:   "An unauthenticated error has a fixed detail and hides its own.",
			err:    &problem.Error{Kind: problem.KindUnauthenticated, Detail: secret, Fields: fields, Err: cause},
			status: http.StatusUnauthorized, slug: "unauthenticated", detail: classUnauthenticated.detail,
		},
		{
			name:   "A forbidden error has a fixed detail and hides its own.",
			err:    &problem.Error{Kind: problem.KindForbidden, Detail: secret, Fields: fields, Err: cause},
			status: http.StatusForbidden, slug: "forbidden", detail: classForbidden.detail,
		},
		{
			name:   "A not-found error shows its detail with 404.",
			err:    problem.Errorf(problem.KindNotFound, "lease not found"),
			status: http.StatusNotFound, slug: "not-found", detail: "lease not found",
		},
		{
			name:   "A too-large error shows its detail with 413.",
			err:    problem.Errorf(problem.KindTooLarge, "too big"),
			status: http.StatusRequestEntityTooLarge, slug: "payload-too-large", detail: "too big",
		},
		{
			name:   "An unsupported-media-type error shows its detail with 415.",
			err:    problem.Errorf(problem.KindUnsupportedMediaType, "json please"),
			status: http.StatusUnsupportedMediaType, slug: "unsupported-media-type", detail: "json please",
		},
		{
			name:   "An unprocessable error shows the broker's detail with 422.",
			err:    problem.Wrap(problem.KindUnprocessable, "granted TTL 10m is below minTTL 1h", cause),
			status: http.StatusUnprocessableEntity, slug: "unprocessable", detail: "granted TTL 10m is below minTTL 1h",
		},
		{
			name:   "An unavailable error has a fixed detail and a Retry-After header.",
			err:    problem.Wrap(problem.KindUnavailable, secret, cause),
			status: http.StatusServiceUnavailable, slug: "unavailable", detail: classUnavailable.detail, retryAfter: "5",
		},
		{
			name:   "An internal error has a fixed detail and hides its own.",
			err:    problem.Wrap(problem.KindInternal, secret, cause),
			status: http.StatusInternalServerError, slug: "internal", detail: classInternal.detail,
		},
		{
			name:   "An unclassified error is an internal error.",
			err:    fmt.Errorf("list secrets: %w", cause),
			status: http.StatusInternalServerError, slug: "internal", detail: classInternal.detail,
		},
		{
			name:   "A kind the server does not know is an internal error.",
			err:    &problem.Error{Kind: problem.Kind(99), Detail: secret},
			status: http.StatusInternalServerError, slug: "internal", detail: classInternal.detail,
		},
		{
			name:   "A wrapped broker error is found in the chain.",
			err:    fmt.Errorf("revoke: %w", problem.Errorf(problem.KindForbidden, "%s", secret)),
			status: http.StatusForbidden, slug: "forbidden", detail: classForbidden.detail,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			h := newHarness(t, &fakeBroker{
				list: func(context.Context, broker.Caller) ([]apiv1.Lease, error) { return nil, tt.err },
			})
			rec := h.do(request{method: http.MethodGet, path: "/v1/leases"})

			p := requireProblem(t, rec, tt.status, tt.slug)
			require.Equal(t, tt.detail, p.Detail)
			require.Equal(t, tt.fields, p.Errors)
			require.Equal(t, "/v1/leases", p.Instance)
			require.Equal(t, tt.retryAfter, rec.Header().Get("Retry-After"))
			require.NotContains(t, rec.Body.String(), "secret")
			require.NotContains(t, rec.Body.String(), testToken)
			requireSecurityHeaders(t, rec.Header())

			// The cause goes to the log, under the request id.
			failed := h.logs.FilterMessage("request failed").All()
			require.Len(t, failed, 1)
			ctx := failed[0].ContextMap()
			require.Equal(t, p.RequestID, ctx["request_id"])
			require.EqualValues(t, tt.status, ctx["status"])
			require.Equal(t, tt.err.Error(), ctx["error"])
		})
	}
}
