package lease

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/zap"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	clocktesting "k8s.io/utils/clock/testing"

	"github.com/tokenbroker/tokenbroker/broker/objects"
)

// The broker's own sequence on a pooled Secret — pooled, claimed
// (claimPatch), Place.Commit on the issuing replica, credential id and an
// earlier expiry recorded — never makes the lease tampered, on the issuing
// replica or another.
func TestTheBrokersOwnWritesOnAPooledLeaseNeverMakeItTampered(t *testing.T) {
	t.Parallel()
	for _, issuing := range []bool{false, true} {
		rules := &Rules{MaxAge: 24*time.Hour + AgeSlack, Peers: map[string]PeerRule{
			"west": {Identity: westID, Namespaces: map[string]struct{}{"argo": {}}},
		}}
		lc := NewCounter(nil, clocktesting.NewFakePassiveClock(tamperNow), zap.NewNop())
		lc.SetRules(func() *Rules { return rules })
		pooled := genuineLease("argo", tamperNow.Add(-time.Minute))
		pooled.Labels = map[string]string{objects.LabelManagedBy: objects.ManagedByValue, objects.LabelKind: objects.PoolKind}
		pooled.Annotations = map[string]string{objects.AnnotationExpiresAt: tamperNow.Add(PoolDeadline).Format(time.RFC3339)}
		lc.Observe(metaOfSecret(pooled))
		if issuing {
			p, _ := lc.Reserve("west", 10, 10)
			p.Commit("argo", pooled.Name, tamperNow.Add(time.Hour))
		}
		claimed := genuineLease("argo", tamperNow.Add(-time.Minute))
		lc.Observe(metaOfSecret(claimed))
		claimed.Annotations[objects.AnnotationCredentialID] = "JTI=x"
		lc.Observe(metaOfSecret(claimed))
		claimed.Annotations[objects.AnnotationExpiresAt] = tamperNow.Add(30 * time.Minute).Format(time.RFC3339)
		lc.Observe(&metav1.PartialObjectMetadata{ObjectMeta: *claimed.ObjectMeta.DeepCopy()})
		require.Empty(t, lc.Tampered(10), "issuing=%v", issuing)
		_, ok := lc.Holds("argo", claimed.Name, claimed.UID, westID, tamperNow)
		require.True(t, ok, "issuing=%v", issuing)
	}
}
