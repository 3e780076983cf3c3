package broker

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/tokenbroker/tokenbroker/broker/policy"
	"github.com/tokenbroker/tokenbroker/broker/policy/policytest"
)

// The shared policy documents, by the names the tests use.
const (
	testPolicy     = policytest.Basic
	tenantPolicy   = policytest.Tenants
	limitsPolicy   = policytest.Limits
	audiencePolicy = policytest.Audiences
	tenantUID      = policytest.TenantUID
)

var ownedPolicy = policytest.Owned

func mustPolicy(t testing.TB, doc string) *policy.Policy {
	t.Helper()
	p, err := policy.Parse([]byte(doc))
	require.NoError(t, err)
	return p
}
