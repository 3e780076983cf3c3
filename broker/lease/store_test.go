package lease

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/zap"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"
	clocktesting "k8s.io/utils/clock/testing"

	"github.com/tokenbroker/tokenbroker/broker/objects"
	"github.com/tokenbroker/tokenbroker/broker/problem"
)

const (
	idA = "aaaaaaaaaaaaaaaaaaaaaaaaaa"
	idB = "bbbbbbbbbbbbbbbbbbbbbbbbbb"
)

var west = Holder{Peer: "west", Identity: "spiffe://oc.example/cluster/west"}

// storeWith is a Store over a fake clientset holding secrets, with a
// synced counter that has seen them, and the number of API calls made.
func storeWith(t *testing.T, secrets ...*corev1.Secret) (*Store, *fake.Clientset) {
	t.Helper()
	clk := clocktesting.NewFakeClock(time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC))
	client := fake.NewClientset()
	lc := NewCounter(nil, clk, zap.NewNop())
	for _, s := range secrets {
		_, err := client.CoreV1().Secrets(s.Namespace).Create(context.Background(), s, metav1.CreateOptions{})
		require.NoError(t, err)
		lc.Observe(&metav1.PartialObjectMetadata{ObjectMeta: s.ObjectMeta})
	}
	require.True(t, lc.Synced())
	client.ClearActions()
	return &Store{Secrets: client.CoreV1(), Counter: lc, Clock: clk}, client
}

func TestFindListsOnlyTheNamespaceTheCounterSawTheLeaseIn(t *testing.T) {
	t.Parallel()
	st, client := storeWith(t,
		NewSecret(idA, "flux", west, "reconciler", "token", "g", time.Date(2030, 1, 2, 4, 0, 0, 0, time.UTC)),
		NewSecret(idB, "elsewhere", west, "reconciler", "token", "g", time.Date(2030, 1, 2, 4, 0, 0, 0, time.UTC)))
	holderNamespaces := []string{"argo", "flux", "zoo"}

	s, err := st.Find(context.Background(), holderNamespaces, west, idA, false)
	require.NoError(t, err)
	require.Equal(t, "flux", s.Namespace)
	require.Len(t, client.Actions(), 1, "one list, in the lease's namespace")
	require.Equal(t, "flux", client.Actions()[0].GetNamespace())

	client.ClearActions()
	_, err = st.Find(context.Background(), holderNamespaces, west, idB, false)
	require.Equal(t, problem.KindNotFound, problem.KindOf(err), "seen only outside the holder's namespaces")
	_, err = st.Find(context.Background(), holderNamespaces, west, "cccccccccccccccccccccccccc", false)
	require.Equal(t, problem.KindNotFound, problem.KindOf(err), "never seen")
	_, err = st.Find(context.Background(), holderNamespaces, west, "not-an-id", false)
	require.Equal(t, problem.KindNotFound, problem.KindOf(err))
	require.Empty(t, client.Actions(), "none of these cost an API call")
}

func TestFindReturnsOnlyTheHoldersLease(t *testing.T) {
	t.Parallel()
	runner := Holder{Peer: "west", Identity: west.Identity, Workload: "ci/runner"}
	deployer := Holder{Peer: "west", Identity: west.Identity, Workload: "ci/deployer"}
	exp := time.Date(2030, 1, 2, 4, 0, 0, 0, time.UTC)
	forged := NewSecret(idB, "ci", west, "reconciler", "token", "g", exp)
	forged.Type = corev1.SecretTypeOpaque // the lease labels on a Secret of another type
	st, _ := storeWith(t, NewSecret(idA, "ci", runner, "reconciler", "token", "g", exp), forged)

	_, err := st.Find(context.Background(), []string{"ci"}, runner, idA, false)
	require.NoError(t, err)
	_, err = st.Find(context.Background(), []string{"ci"}, west, idA, false)
	require.NoError(t, err, "a caller without a workload sees every lease of its identity")
	_, err = st.Find(context.Background(), []string{"ci"}, deployer, idA, false)
	require.Equal(t, problem.KindNotFound, problem.KindOf(err), "another workload's lease")
	_, err = st.Find(context.Background(), []string{"ci"}, Holder{Peer: "south", Identity: "spiffe://oc.example/cluster/south"}, idA, false)
	require.Equal(t, problem.KindNotFound, problem.KindOf(err), "another peer's lease")
	_, err = st.Find(context.Background(), []string{"ci"}, west, idB, false)
	require.Equal(t, problem.KindNotFound, problem.KindOf(err), "not of the lease type")
	require.Equal(t, objects.LeaseSecretPrefix+idA, NewSecret(idA, "ci", runner, "", "", "", exp).Name)
}
