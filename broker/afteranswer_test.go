package broker

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	k8stesting "k8s.io/client-go/testing"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/broker/lease"
	"github.com/tokenbroker/tokenbroker/broker/objects"
	"github.com/tokenbroker/tokenbroker/broker/policy"
)

// credentialIDOf reads the credential-id annotation of a lease.
func (e *env) credentialIDOf(t *testing.T, id string) string {
	t.Helper()
	s, err := e.client.CoreV1().Secrets("argo").Get(context.Background(), objects.LeaseSecretPrefix+id, metav1.GetOptions{})
	require.NoError(t, err)
	return s.Annotations[objects.AnnotationCredentialID]
}

// holdCredentialIDWrites makes the broker write credential ids in the
// background and holds every lease patch until release is closed.
func (e *env) holdCredentialIDWrites() (release chan struct{}) {
	e.b.after = lease.NewAfterAnswer(maxWritesAfterAnswers, func(f func()) { go f() })
	release = make(chan struct{})
	e.client.PrependReactor("patch", "secrets", func(k8stesting.Action) (bool, runtime.Object, error) {
		<-release
		return false, nil, nil
	})
	return release
}

func TestTheCredentialIDIsWrittenAfterTheAnswer(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	release := e.holdCredentialIDWrites()
	// The patch is held: the answer comes all the same.
	resp, err := e.b.IssueKubeconfig(context.Background(), west, apiv1.KubeconfigRequest{Namespace: "argo", ServiceAccount: "admiralty-source", TTL: "1h"})
	require.NoError(t, err)
	require.Empty(t, resp.ClampedBy)
	require.Empty(t, e.credentialIDOf(t, resp.LeaseID), "not written before the patch goes through")
	close(release)
	require.NoError(t, e.b.WaitWritesAfterAnswers(context.Background()))
	require.Equal(t, "JTI=jti-42", e.credentialIDOf(t, resp.LeaseID))
}

func TestWhenEveryWriteSlotIsTakenAnIssuanceWritesItsOwnCredentialID(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	started := false
	e.b.after = lease.NewAfterAnswer(0, func(f func()) { started = true; go f() }) // every slot taken
	resp, err := e.b.IssueKubeconfig(context.Background(), west, apiv1.KubeconfigRequest{Namespace: "argo", ServiceAccount: "admiralty-source", TTL: "1h"})
	require.NoError(t, err)
	require.False(t, started, "no write in the background past the bound")
	require.Equal(t, "JTI=jti-42", e.credentialIDOf(t, resp.LeaseID), "written before the answer")
}

func TestAFailedCredentialIDWriteCostsOnlyTheAnnotation(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.client.PrependReactor("patch", "secrets", func(k8stesting.Action) (bool, runtime.Object, error) {
		return true, nil, errors.New("connection refused")
	})
	resp, err := e.b.IssueKubeconfig(context.Background(), west, apiv1.KubeconfigRequest{Namespace: "argo", ServiceAccount: "admiralty-source", TTL: "1h"})
	require.NoError(t, err, "the credential was issued; its id is in the audit event")
	require.NoError(t, e.b.WaitWritesAfterAnswers(context.Background()))
	require.Empty(t, e.credentialIDOf(t, resp.LeaseID), "the lease stands without the annotation")
	require.Equal(t, 1, e.logs.FilterMessage("could not record the credential id on the lease Secret; the issuance's audit event has it").Len())
}

func TestAnExpiryTheAPIServerShortenedIsWrittenWithTheCredentialIDBeforeTheAnswer(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.b.after = lease.NewAfterAnswer(maxWritesAfterAnswers, func(func()) { t.Error("a write in the background when the expiry had to be written anyway") })
	e.iss.shorten = 40 * time.Minute // the API server grants 20m of the asked hour
	resp, err := e.b.IssueKubeconfig(context.Background(), west, apiv1.KubeconfigRequest{Namespace: "argo", ServiceAccount: "admiralty-source", TTL: "1h"})
	require.NoError(t, err)
	require.Equal(t, policy.ClampedByAPIServer, resp.ClampedBy)
	require.Equal(t, "JTI=jti-42", e.credentialIDOf(t, resp.LeaseID))
}

func TestWaitWritesAfterAnswersWaitsForTheWritesInFlightWithinItsContext(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	release := e.holdCredentialIDWrites()
	resp, err := e.b.IssueKubeconfig(context.Background(), west, apiv1.KubeconfigRequest{Namespace: "argo", ServiceAccount: "admiralty-source", TTL: "1h"})
	require.NoError(t, err)
	ended, cancel := context.WithCancel(context.Background())
	cancel()
	require.ErrorIs(t, e.b.WaitWritesAfterAnswers(ended), context.Canceled, "a write is in flight: the wait ends with its context")
	close(release)
	require.NoError(t, e.b.WaitWritesAfterAnswers(context.Background()))
	require.Equal(t, "JTI=jti-42", e.credentialIDOf(t, resp.LeaseID), "written when the wait returns")
}
