package client

import (
	"context"
	"crypto/x509"
	"errors"
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/tokenbroker/tokenbroker/pki"
)

func TestRetryable(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name string
		err  error
		want bool
	}{
		{"a 503 may go away", &ProblemError{Status: 503}, true},
		{"a 429 may go away", &ProblemError{Status: 429}, true},
		{"a 403 will not", &ProblemError{Status: 403}, false},
		{"a 422 will not", &ProblemError{Status: 422}, false},
		{"a connection error may go away", errors.New("dial tcp 127.0.0.1:8443: connect: connection refused"), true},
		{"a cancelled request is not retried", fmt.Errorf("post: %w", context.Canceled), false},
		{"a wrong CA pin is not retried", fmt.Errorf("bootstrap: %w", pki.ErrFingerprintMismatch), false},
		{"a broker certificate from an unknown CA is not retried", fmt.Errorf("post: %w", x509.UnknownAuthorityError{}), false},
		{"a broker certificate for another host is not retried", fmt.Errorf("post: %w", x509.HostnameError{}), false},
		{"no error is not retried", nil, false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			require.Equal(t, tc.want, Retryable(tc.err))
		})
	}
}
