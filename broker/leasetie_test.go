package broker

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"
	"go.uber.org/zap"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/broker/lease"
	"github.com/tokenbroker/tokenbroker/broker/objects"
	"github.com/tokenbroker/tokenbroker/broker/problem"
)

// A copy a tenant makes in the same second as the lease, in a namespace
// of the same peer that sorts first, cannot be told from the lease
// (creation times are in whole seconds; a replica that relists sees
// them in namespace order). The owner's DELETE revokes both, so the
// lease never outlives it. (An attacker review's finding.)
func TestTheOwnersDeleteRevokesACopyMadeInTheSameSecondAndTheLease(t *testing.T) {
	t.Parallel()
	e := newForgeryEnv(t)
	ctx := context.Background()
	resp, err := e.b.IssueKubeconfig(ctx, west, apiv1.KubeconfigRequest{Namespace: "flux", ServiceAccount: "reader"})
	require.NoError(t, err)
	real, err := e.client.CoreV1().Secrets("flux").Get(ctx, objects.LeaseSecretPrefix+resp.LeaseID, metav1.GetOptions{})
	require.NoError(t, err)
	real.UID, real.CreationTimestamp = "genuine", metav1.NewTime(e.clock.Now())
	real, err = e.client.CoreV1().Secrets("flux").Update(ctx, real, metav1.UpdateOptions{})
	require.NoError(t, err)
	copied := forgedSecret(real, "argo", objects.SecretTypeLease, e.clock.Now())
	_, err = e.client.CoreV1().Secrets("argo").Create(ctx, copied, metav1.CreateOptions{})
	require.NoError(t, err)
	lc := lease.NewCounter(nil, e.clock, zap.NewNop())
	e.b.cfg.Leases = lc
	lc.Observe(metaOf(copied))
	lc.Observe(metaOf(real))

	require.NoError(t, e.b.RevokeLease(ctx, west, resp.LeaseID))
	for _, ns := range []string{"flux", "argo"} {
		_, err = e.client.CoreV1().Secrets(ns).Get(ctx, real.Name, metav1.GetOptions{})
		require.True(t, problem.IsNotFound(err), "%s: %v", ns, err)
	}
}
