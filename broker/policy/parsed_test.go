package policy

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// parsed is doc parsed and validated as the broker loads a policy.
func parsed(t *testing.T, doc string) *Policy {
	t.Helper()
	p, err := Parse([]byte(doc))
	require.NoError(t, err)
	return p
}
