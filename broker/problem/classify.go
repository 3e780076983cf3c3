package problem

import (
	"context"
	"errors"
	"fmt"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
)

// classify turns an error from the Kubernetes API into a classified *Error.
// notFound is the caller-safe detail for a 404. Transport failures and the
// API server's own overload or outage answers are KindUnavailable (the
// request may be retried); what the API server refuses as invalid is
// KindUnprocessable; anything else is internal (an operator problem, such
// as missing RBAC for the broker).
func Classify(err error, what, notFound string) error {
	if err == nil {
		return nil
	}
	wrapped := fmt.Errorf("%s: %w", what, err)
	var status apierrors.APIStatus
	switch {
	case errors.Is(err, context.Canceled):
		return Wrap(KindUnavailable, "the request was cancelled", wrapped)
	case apierrors.IsNotFound(err):
		return Wrap(KindNotFound, notFound, wrapped)
	case apierrors.IsServiceUnavailable(err), apierrors.IsTimeout(err), apierrors.IsServerTimeout(err),
		apierrors.IsTooManyRequests(err), apierrors.IsInternalError(err), errors.Is(err, context.DeadlineExceeded):
		return Wrap(KindUnavailable, "the Kubernetes API server is unavailable", wrapped)
	case apierrors.IsInvalid(err), apierrors.IsBadRequest(err):
		return Wrap(KindUnprocessable, "the Kubernetes API server refused the request: "+apiMessage(err), wrapped)
	case !errors.As(err, &status):
		// No status from the API server at all: the connection failed.
		return Wrap(KindUnavailable, "the Kubernetes API server is unavailable", wrapped)
	}
	return Wrap(KindInternal, "", wrapped)
}

func apiMessage(err error) string {
	var status apierrors.APIStatus
	if errors.As(err, &status) {
		return status.Status().Message
	}
	return ""
}

// aPIErrorReason is the reason label of
// tokenbroker_apiserver_call_errors_total for a failed API call.
func APIErrorReason(err error) string {
	var status apierrors.APIStatus
	switch {
	case apierrors.IsNotFound(err):
		return "not_found"
	case apierrors.IsForbidden(err), apierrors.IsUnauthorized(err):
		return "forbidden"
	case apierrors.IsAlreadyExists(err), apierrors.IsConflict(err):
		return "conflict"
	case apierrors.IsInvalid(err), apierrors.IsBadRequest(err):
		return "invalid"
	case apierrors.IsServiceUnavailable(err), apierrors.IsTimeout(err), apierrors.IsServerTimeout(err),
		apierrors.IsTooManyRequests(err), apierrors.IsInternalError(err),
		errors.Is(err, context.DeadlineExceeded), errors.Is(err, context.Canceled), !errors.As(err, &status):
		return "unavailable"
	}
	return "other"
}

func IsNotFound(err error) bool { return apierrors.IsNotFound(err) }
