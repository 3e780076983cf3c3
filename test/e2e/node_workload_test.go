//go:build node

package e2e

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	authenticationv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	clientauthv1 "k8s.io/client-go/pkg/apis/clientauthentication/v1"

	"github.com/tokenbroker/tokenbroker/test/testcluster"
)

// TestNodeWorkloadIdentityFromAPod runs the exec plugin where it runs in
// production: in a Pod of the source cluster (west, with a node), with the
// ServiceAccount token the kubelet projects into it for the audience east's
// broker pins. The Pod of argo/runner gets a credential that authenticates
// to east as argo/runner; a Pod of another ServiceAccount is refused. A
// projected token is bound to its Pod, and the broker verifies it offline
// against the keys west's agent uploads; with livePodsFromPeer the agent
// also reports west's live Pods, and the test measures how soon after its
// Pod is deleted the token is refused (docs/security.md).
func TestNodeWorkloadIdentityFromAPod(t *testing.T) {
	east := testcluster.Start(t)
	west := testcluster.Start(t, testcluster.WithNode())
	setUpTarget(t, east)
	createServiceAccounts(t, west, "argo", "runner", "other")
	_, err := east.Client.CoreV1().Namespaces().Create(t.Context(), &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "tokenbroker"}}, metav1.CreateOptions{})
	require.NoError(t, err)
	e := newBrokerEnv(t, east)
	writeFile(t, e.policy, workloadPolicy(east, west, "      requirePodBinding: true\n      livePodsFromPeer: true\n"))
	e.launch(t)
	startKeyUploader(t, e, west, fmt.Sprintf("  livePods: {audiences: [%s], interval: 5s}\n", workloadAudience))
	require.NoError(t, west.Node.ImportImage(t.Context(), imageArchive(t)))

	// The Pods' identity: west's client certificate, as the agent chart
	// mounts it.
	secret := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "west-identity", Namespace: "argo"}, Data: map[string][]byte{}}
	for _, f := range []string{"tls.crt", "tls.key", "ca.crt"} {
		b, err := os.ReadFile(filepath.Join(identityDir(t, e), f))
		require.NoError(t, err)
		secret.Data[f] = b
	}
	_, err = west.Client.CoreV1().Secrets("argo").Create(t.Context(), secret, metav1.CreateOptions{})
	require.NoError(t, err)

	runner := runCredentialPod(t, west, e, "runner")
	require.Equal(t, corev1.PodRunning, runner.phase, runner.logs)
	var cred clientauthv1.ExecCredential
	require.NoError(t, json.Unmarshal([]byte(runner.logs), &cred), runner.logs)
	require.NotNil(t, cred.Status)
	review, err := east.Client.AuthenticationV1().TokenReviews().Create(t.Context(), &authenticationv1.TokenReview{
		Spec: authenticationv1.TokenReviewSpec{Token: cred.Status.Token},
	}, metav1.CreateOptions{})
	require.NoError(t, err)
	require.True(t, review.Status.Authenticated, review.Status.Error)
	require.Equal(t, "system:serviceaccount:argo:runner", review.Status.User.Username)
	e.requireLog(t, `"workload":"argo/runner"`)

	other := runCredentialPod(t, west, e, "other")
	require.Equal(t, corev1.PodFailed, other.phase, other.logs)
	require.Contains(t, other.logs, "403", "the broker forbids another workload")

	// The projected token the kubelet wrote for the runner Pod, read from
	// the node's disk: good while the Pod lives, refused once it is gone.
	token := runner.token
	body := `{"namespace":"argo","serviceAccount":"runner","ttl":"1h"}`
	status, out := e.postKubeconfig(t, filepath.Join(e.dir, "west"), body, "-H", "Authorization: Bearer "+token)
	require.Equal(t, 201, status, "the live Pod's token, presented by hand: %s", out)
	require.NoError(t, west.Client.CoreV1().Pods("argo").Delete(t.Context(), runner.name, metav1.DeleteOptions{}))
	require.Eventually(t, func() bool {
		_, err := west.Client.CoreV1().Pods("argo").Get(t.Context(), runner.name, metav1.GetOptions{})
		return apierrors.IsNotFound(err)
	}, 60*time.Second, 200*time.Millisecond, "the Pod is deleted")
	gone := time.Now()
	require.Eventually(t, func() bool {
		status, out = e.postKubeconfig(t, filepath.Join(e.dir, "west"), body, "-H", "Authorization: Bearer "+token)
		return status != 201
	}, 10*time.Second, 50*time.Millisecond, "a deleted Pod's token is refused once the agent reports the Pods without it")
	refused := time.Since(gone)
	require.Equal(t, 401, status, out)
	require.Equal(t, "pod-not-live", problemReason(t, out))
	t.Logf("a deleted Pod's projected token (valid until %s) was refused %s after the Pod was gone from west's API server",
		runner.tokenExpiry.Format(time.RFC3339), refused.Round(10*time.Millisecond))
}

// credentialPod is how a Pod that ran the exec plugin went: Running when
// the plugin succeeded, Failed when it did not.
type credentialPod struct {
	name        string
	phase       corev1.PodPhase
	logs        string
	token       string // the projected token, read from the node
	tokenExpiry time.Time
}

// runCredentialPod runs `tokenbroker credential` once in a Pod of
// argo/serviceAccount in west, on the host's network (where e's broker
// listens on 127.0.0.1), with west's identity and a projected token for
// the workload audience, and returns how it went, with the token.
func runCredentialPod(t *testing.T, west *testcluster.Cluster, e *brokerEnv, serviceAccount string) credentialPod {
	t.Helper()
	name := "credential-" + serviceAccount
	expiration := int64(600)
	nonroot := int64(65532)
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "argo"},
		Spec: corev1.PodSpec{
			ServiceAccountName:           serviceAccount,
			AutomountServiceAccountToken: ptrTo(false),
			HostNetwork:                  true,
			RestartPolicy:                corev1.RestartPolicyNever,
			SecurityContext:              &corev1.PodSecurityContext{RunAsUser: &nonroot, RunAsGroup: &nonroot, FSGroup: &nonroot},
			// The plugin runs as an init container; the Pod then stays
			// Running (and its token on the node's disk) with the node
			// image's pause container.
			Containers: []corev1.Container{{Name: "hold", Image: testcluster.NodeImageRef, ImagePullPolicy: corev1.PullNever}},
			InitContainers: []corev1.Container{{
				Name: "credential", Image: imageRef(t), ImagePullPolicy: corev1.PullNever,
				Args: []string{"credential", "--broker", "https://" + e.api, "--identity-dir", "/identity",
					"--namespace", "argo", "--service-account", "runner", "--ttl", "1h",
					"--workload-token-file", "/var/run/secrets/tokenbroker/token", "--no-cache"},
				VolumeMounts: []corev1.VolumeMount{
					{Name: "identity", MountPath: "/identity", ReadOnly: true},
					{Name: "workload-token", MountPath: "/var/run/secrets/tokenbroker", ReadOnly: true},
				},
			}},
			Volumes: []corev1.Volume{
				{Name: "identity", VolumeSource: corev1.VolumeSource{Secret: &corev1.SecretVolumeSource{SecretName: "west-identity", DefaultMode: ptrTo(int32(0o440))}}},
				{Name: "workload-token", VolumeSource: corev1.VolumeSource{Projected: &corev1.ProjectedVolumeSource{Sources: []corev1.VolumeProjection{{
					ServiceAccountToken: &corev1.ServiceAccountTokenProjection{Audience: workloadAudience, ExpirationSeconds: &expiration, Path: "token"},
				}}}}},
			},
		},
	}
	created, err := west.Client.CoreV1().Pods("argo").Create(t.Context(), pod, metav1.CreateOptions{})
	require.NoError(t, err)
	var p *corev1.Pod
	require.Eventually(t, func() bool {
		p, err = west.Client.CoreV1().Pods("argo").Get(t.Context(), name, metav1.GetOptions{})
		return err == nil && (p.Status.Phase == corev1.PodRunning || p.Status.Phase == corev1.PodFailed)
	}, 90*time.Second, 200*time.Millisecond, "the Pod %s never ran its plugin", name)
	logs, err := west.Client.CoreV1().Pods("argo").GetLogs(name, &corev1.PodLogOptions{Container: "credential"}).DoRaw(t.Context())
	require.NoError(t, err)
	out := credentialPod{name: name, phase: p.Status.Phase, logs: strings.TrimSpace(string(logs))}
	if p.Status.Phase == corev1.PodFailed {
		return out
	}
	tokenFile := filepath.Join(west.Node.Dir, "kubelet", "pods", string(created.UID), "volumes", "kubernetes.io~projected", "workload-token", "token")
	b, err := os.ReadFile(tokenFile)
	require.NoError(t, err, "the kubelet projects the token to %s", tokenFile)
	out.token = string(b)
	review, err := west.Client.AuthenticationV1().TokenReviews().Create(t.Context(), &authenticationv1.TokenReview{
		Spec: authenticationv1.TokenReviewSpec{Token: out.token, Audiences: []string{workloadAudience}},
	}, metav1.CreateOptions{})
	require.NoError(t, err)
	require.True(t, review.Status.Authenticated, "west's API server accepts the projected token while its Pod exists: %s", review.Status.Error)
	require.Equal(t, authenticationv1.ExtraValue{name}, review.Status.User.Extra["authentication.kubernetes.io/pod-name"], "it is bound to its Pod")
	out.tokenExpiry = time.Now().Add(time.Duration(expiration) * time.Second)
	return out
}

// imageArchive is make image's docker-archive of the host's platform
// (TOKENBROKER_IMAGE_DIR, else dist/image).
func imageArchive(t *testing.T) string {
	t.Helper()
	dir := os.Getenv("TOKENBROKER_IMAGE_DIR")
	if dir == "" {
		dir = filepath.Join(repoRoot(t), "dist", "image")
	}
	ref := imageRef(t)
	path := filepath.Join(dir, fmt.Sprintf("tokenbroker-%s-linux-%s.tar", ref[strings.LastIndex(ref, ":")+1:], runtime.GOARCH))
	require.FileExists(t, path, "run make image first")
	return path
}
