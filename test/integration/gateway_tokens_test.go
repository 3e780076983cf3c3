package integration

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	authnv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/tokenbroker/tokenbroker/broker/objects"
	"github.com/tokenbroker/tokenbroker/pki"
	"github.com/tokenbroker/tokenbroker/server/gateway"
	"github.com/tokenbroker/tokenbroker/test/testcluster"
)

// TestTheGatewaysUpstreamTokenIsAcceptedAndDiesWithItsLeaseSecret is what
// the chart's gateway could not do while its tokens were bound to the
// broker's Pod: the API server takes a bound object only in the
// ServiceAccount's own namespace, where the broker's Pod is not, so every
// TokenRequest failed. A token bound to the lease Secret is accepted, and
// the API server refuses it once the Secret is deleted.
func TestTheGatewaysUpstreamTokenIsAcceptedAndDiesWithItsLeaseSecret(t *testing.T) {
	c := testcluster.Start(t)
	ctx := context.Background()
	ensureNamespace(t, c, "argo")
	_, err := c.Client.CoreV1().ServiceAccounts("argo").Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "runner"}}, metav1.CreateOptions{})
	require.NoError(t, err)
	const id = "abcdefghijklmnopqrstuvwxyz"
	secret, err := c.Client.CoreV1().Secrets("argo").Create(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: objects.LeaseSecretPrefix + id}}, metav1.CreateOptions{})
	require.NoError(t, err)
	lease := pki.LeaseName{Namespace: "argo", ServiceAccount: "runner", ID: id, UID: string(secret.UID), Peer: "spiffe://it.tokenbroker.test/cluster/west"}

	tokens := &gateway.Tokens{SA: c.Client.CoreV1()}
	token, err := tokens.Token(ctx, lease)
	require.NoError(t, err)
	again, err := tokens.Token(ctx, lease)
	require.NoError(t, err)
	require.Equal(t, token, again, "one token per lease, kept until its renewal")

	review := func() *authnv1.TokenReviewStatus {
		t.Helper()
		out, err := c.Client.AuthenticationV1().TokenReviews().Create(ctx, &authnv1.TokenReview{Spec: authnv1.TokenReviewSpec{Token: token}}, metav1.CreateOptions{})
		require.NoError(t, err)
		return &out.Status
	}
	st := review()
	require.True(t, st.Authenticated, "the API server takes the token: %s", st.Error)
	require.Equal(t, "system:serviceaccount:argo:runner", st.User.Username)

	require.NoError(t, c.Client.CoreV1().Secrets("argo").Delete(ctx, secret.Name, metav1.DeleteOptions{}))
	// The API server caches an authentication for about 10 s.
	require.Eventually(t, func() bool { return !review().Authenticated }, 30*time.Second, 250*time.Millisecond,
		"the token died with its lease Secret")
}
