package integration

import (
	"context"
	"net/http"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	authnv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	clocktesting "k8s.io/utils/clock/testing"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/broker"
	"github.com/tokenbroker/tokenbroker/broker/lease"
	"github.com/tokenbroker/tokenbroker/broker/objects"
	"github.com/tokenbroker/tokenbroker/broker/policy"
)

// The lease pool (broker/pool.go) against a real kube-apiserver: a token
// issued on a claimed Secret is a lease like any other, revoked by the
// API server when the Secret goes; a claim cut off by a crash leaves a
// token the GC revokes at the pooled Secret's deadline.
func TestPooledLeasesAgainstARealAPIServer(t *testing.T) {
	s, west := setUp(t)
	ctx := context.Background()
	req := apiv1.KubeconfigRequest{Namespace: "argo", ServiceAccount: "runner", TTL: "1h"}

	// The first token in argo is sequential and asks for a pool there.
	first := issue(t, s, west, req)
	pooled := func() []corev1.Secret {
		l, err := s.cluster.Client.CoreV1().Secrets("argo").List(ctx, metav1.ListOptions{LabelSelector: objects.LabelKind + "=" + objects.PoolKind})
		require.NoError(t, err)
		return l.Items
	}
	require.Eventually(t, func() bool { return len(pooled()) == lease.DefaultPoolPerNamespace }, 20*time.Second, 20*time.Millisecond)

	resp := issue(t, s, west, req)
	require.Equal(t, 1.0, counter(t, s.reg, "tokenbroker_lease_pool_issuances_total", map[string]string{"path": "pool"}))
	require.True(t, review(t, s.cluster.Client, resp.Token).Authenticated)
	var claimed *corev1.Secret
	for _, sec := range leaseSecrets(t, s.cluster.Client) {
		if sec.Labels[objects.LabelLeaseID] == resp.LeaseID {
			claimed = &sec
		}
	}
	require.NotNil(t, claimed, "the claimed Secret is the lease")
	require.Equal(t, objects.LeaseKind, claimed.Labels[objects.LabelKind])
	require.Equal(t, resp.ExpiresAt.UTC().Format(time.RFC3339), claimed.Annotations[objects.AnnotationExpiresAt])
	claims := jwtClaims(t, resp.Token)
	k8s := claims["kubernetes.io"].(map[string]any)
	require.Equal(t, string(claimed.UID), k8s["secret"].(map[string]any)["uid"], "bound to the claimed Secret")

	var list apiv1.LeaseList
	status, body := do(t, west, http.MethodGet, s.url+"/v1/leases", nil, &list)
	require.Equal(t, http.StatusOK, status, string(body))
	ids := map[string]bool{}
	for _, l := range list.Items {
		ids[l.ID] = true
	}
	require.Equal(t, map[string]bool{first.LeaseID: true, resp.LeaseID: true}, ids, "pooled Secrets are not listed")

	status, body = do(t, west, http.MethodDelete, s.url+"/v1/leases/"+resp.LeaseID, nil, nil)
	require.Equal(t, http.StatusNoContent, status, string(body))
	require.Eventually(t, func() bool { return !review(t, s.cluster.Client, resp.Token).Authenticated },
		20*time.Second, 50*time.Millisecond, "revoking a pooled lease revokes its token")

	t.Run("a claim cut off by a crash is revoked at the deadline", func(t *testing.T) {
		// What a replica leaves when it stops between the TokenRequest and
		// the claim: a pooled Secret with a token bound to it.
		victim := pooled()[0]
		seconds := int64(3600)
		tr, err := s.cluster.Client.CoreV1().ServiceAccounts("argo").CreateToken(ctx, "runner", &authnv1.TokenRequest{Spec: authnv1.TokenRequestSpec{
			ExpirationSeconds: &seconds,
			BoundObjectRef:    &authnv1.BoundObjectReference{Kind: "Secret", APIVersion: "v1", Name: victim.Name, UID: victim.UID},
		}}, metav1.CreateOptions{})
		require.NoError(t, err)
		require.True(t, review(t, s.cluster.Client, tr.Status.Token).Authenticated)

		// Any replica's GC, once the deadline has passed.
		p, err := policy.LoadFile(s.policyFile)
		require.NoError(t, err)
		later, err := broker.New(broker.Config{
			Secrets: s.cluster.Client.CoreV1(),
			Policy:  policy.NewStore(p),
			Logger:  zapNop(),
			Clock:   clocktesting.NewFakeClock(time.Now().Add(11 * time.Minute)),
		})
		require.NoError(t, err)
		_, err = later.CollectGarbage(ctx)
		require.NoError(t, err)
		require.Eventually(t, func() bool { return !review(t, s.cluster.Client, tr.Status.Token).Authenticated },
			20*time.Second, 50*time.Millisecond)
		require.True(t, review(t, s.cluster.Client, first.Token).Authenticated, "the live lease is kept")
	})
}
