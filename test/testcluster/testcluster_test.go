package testcluster

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	authenticationv1 "k8s.io/api/authentication/v1"
	certificatesv1 "k8s.io/api/certificates/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
)

func skipIfShort(t *testing.T) {
	t.Helper()
	if testing.Short() {
		t.Skip("starts a real kube-apiserver; skipped with -short")
	}
}

// createServiceAccount creates a namespace and a ServiceAccount in it.
func createServiceAccount(ctx context.Context, t *testing.T, client kubernetes.Interface, ns, name string) {
	t.Helper()
	_, err := client.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{})
	require.NoError(t, err)
	_, err = client.CoreV1().ServiceAccounts(ns).Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: name}}, metav1.CreateOptions{})
	require.NoError(t, err)
}

func requestToken(ctx context.Context, t *testing.T, client kubernetes.Interface, ns, name string, ttl time.Duration) *authenticationv1.TokenRequest {
	t.Helper()
	seconds := int64(ttl / time.Second)
	tr, err := client.CoreV1().ServiceAccounts(ns).CreateToken(ctx, name, &authenticationv1.TokenRequest{
		Spec: authenticationv1.TokenRequestSpec{ExpirationSeconds: &seconds},
	}, metav1.CreateOptions{})
	require.NoError(t, err)
	require.NotEmpty(t, tr.Status.Token)
	return tr
}

func TestServiceAccountTokensAreIssuedVerifiedAndConfinedByRBAC(t *testing.T) {
	skipIfShort(t)
	t.Parallel()
	c := Start(t, WithMaxTokenExpiration(time.Hour))
	ctx := t.Context()
	createServiceAccount(ctx, t, c.Client, "team-a", "robot")
	const username = "system:serviceaccount:team-a:robot"

	t.Run("a TokenRequest within the cap gets the TTL it asked for", func(t *testing.T) {
		tr := requestToken(ctx, t, c.Client, "team-a", "robot", 20*time.Minute)
		require.WithinDuration(t, time.Now().Add(20*time.Minute), tr.Status.ExpirationTimestamp.Time, time.Minute)
	})

	t.Run("the API server shortens a TokenRequest above --service-account-max-token-expiration", func(t *testing.T) {
		tr := requestToken(ctx, t, c.Client, "team-a", "robot", 2*time.Hour)
		require.WithinDuration(t, time.Now().Add(time.Hour), tr.Status.ExpirationTimestamp.Time, time.Minute)
	})

	t.Run("TokenReview authenticates the token as the ServiceAccount", func(t *testing.T) {
		tr := requestToken(ctx, t, c.Client, "team-a", "robot", 20*time.Minute)
		review, err := c.Client.AuthenticationV1().TokenReviews().Create(ctx, &authenticationv1.TokenReview{
			Spec: authenticationv1.TokenReviewSpec{Token: tr.Status.Token},
		}, metav1.CreateOptions{})
		require.NoError(t, err)
		require.True(t, review.Status.Authenticated, review.Status.Error)
		require.Equal(t, username, review.Status.User.Username)
		require.Equal(t, c.APIAudiences, review.Status.Audiences)
	})

	t.Run("a client built with TokenConfig acts as the ServiceAccount", func(t *testing.T) {
		tr := requestToken(ctx, t, c.Client, "team-a", "robot", 20*time.Minute)
		saClient, err := kubernetes.NewForConfig(c.TokenConfig(tr.Status.Token))
		require.NoError(t, err)
		self, err := saClient.AuthenticationV1().SelfSubjectReviews().Create(ctx, &authenticationv1.SelfSubjectReview{}, metav1.CreateOptions{})
		require.NoError(t, err)
		require.Equal(t, username, self.Status.UserInfo.Username)

		t.Run("and RBAC denies it listing secrets", func(t *testing.T) {
			_, err := saClient.CoreV1().Secrets("team-a").List(ctx, metav1.ListOptions{})
			require.True(t, apierrors.IsForbidden(err), "want Forbidden, got %v", err)
		})
	})

	t.Run("a garbage token is rejected", func(t *testing.T) {
		saClient, err := kubernetes.NewForConfig(c.TokenConfig("not-a-token"))
		require.NoError(t, err)
		_, err = saClient.AuthenticationV1().SelfSubjectReviews().Create(ctx, &authenticationv1.SelfSubjectReview{}, metav1.CreateOptions{})
		require.True(t, apierrors.IsUnauthorized(err), "want Unauthorized, got %v", err)
	})

	t.Run("the admin kubeconfig file reaches the cluster as an admin", func(t *testing.T) {
		cfg, err := clientcmd.BuildConfigFromFlags("", c.KubeconfigPath)
		require.NoError(t, err)
		client, err := kubernetes.NewForConfig(cfg)
		require.NoError(t, err)
		self, err := client.AuthenticationV1().SelfSubjectReviews().Create(ctx, &authenticationv1.SelfSubjectReview{}, metav1.CreateOptions{})
		require.NoError(t, err)
		require.Contains(t, self.Status.UserInfo.Groups, "system:masters")
		fi, err := os.Stat(c.KubeconfigPath)
		require.NoError(t, err)
		require.Equal(t, os.FileMode(0o600), fi.Mode().Perm(), "the kubeconfig holds a private key")
	})
}

func TestTwoClustersRunAtOnceAndAreIsolated(t *testing.T) {
	skipIfShort(t)
	t.Parallel()
	var (
		wg       sync.WaitGroup
		clusters [2]*Cluster
	)
	for i := range clusters {
		wg.Go(func() { clusters[i] = Start(t) })
	}
	wg.Wait()
	if t.Failed() {
		t.FailNow()
	}
	a, b := clusters[0], clusters[1]
	require.NotEqual(t, a.URL, b.URL)
	require.NotEqual(t, a.Dir, b.Dir)
	require.NotEqual(t, a.CAData, b.CAData)

	ctx := t.Context()
	createServiceAccount(ctx, t, a.Client, "only-in-a", "robot")
	_, err := b.Client.CoreV1().Namespaces().Get(ctx, "only-in-a", metav1.GetOptions{})
	require.True(t, apierrors.IsNotFound(err), "want NotFound, got %v", err)

	// Each cluster signs tokens with its own key.
	tr := requestToken(ctx, t, a.Client, "only-in-a", "robot", 20*time.Minute)
	review, err := b.Client.AuthenticationV1().TokenReviews().Create(ctx, &authenticationv1.TokenReview{
		Spec: authenticationv1.TokenReviewSpec{Token: tr.Status.Token},
	}, metav1.CreateOptions{})
	require.NoError(t, err)
	require.False(t, review.Status.Authenticated)
}

func TestAPIServerRestartKeepsDataURLAndTokens(t *testing.T) {
	skipIfShort(t)
	t.Parallel()
	c, err := Run(t.Context())
	require.NoError(t, err)
	dir := c.Dir
	firstPID := c.apiserver.cmd.Process.Pid
	stopped := false
	t.Cleanup(func() {
		if !stopped {
			_ = c.Stop()
		}
	})

	ctx := t.Context()
	createServiceAccount(ctx, t, c.Client, "survivor", "robot")
	tr := requestToken(ctx, t, c.Client, "survivor", "robot", 20*time.Minute)
	url := c.URL

	require.NoError(t, c.StopAPIServer())
	require.NoError(t, c.StopAPIServer(), "stopping a stopped API server is a no-op")
	require.False(t, processAlive(firstPID), "kube-apiserver still running after StopAPIServer")
	_, err = c.Client.CoreV1().Namespaces().Get(ctx, "survivor", metav1.GetOptions{})
	require.Error(t, err, "the API server answered while stopped")

	begin := time.Now()
	require.NoError(t, c.StartAPIServer(ctx))
	t.Logf("kube-apiserver restarted in %s", time.Since(begin).Round(time.Millisecond))
	require.Error(t, c.StartAPIServer(ctx), "a second API server must not start")
	require.Equal(t, url, c.URL)

	_, err = c.Client.CoreV1().ServiceAccounts("survivor").Get(ctx, "robot", metav1.GetOptions{})
	require.NoError(t, err, "data must survive the restart")
	saClient, err := kubernetes.NewForConfig(c.TokenConfig(tr.Status.Token))
	require.NoError(t, err)
	self, err := saClient.AuthenticationV1().SelfSubjectReviews().Create(ctx, &authenticationv1.SelfSubjectReview{}, metav1.CreateOptions{})
	require.NoError(t, err, "a token minted before the restart must still work")
	require.Equal(t, "system:serviceaccount:survivor:robot", self.Status.UserInfo.Username)

	t.Run("Stop leaves no process and no directory behind", func(t *testing.T) {
		secondPID := c.apiserver.cmd.Process.Pid
		require.NoError(t, c.Stop())
		stopped = true
		require.NoError(t, c.Stop(), "Stop is idempotent")
		require.False(t, processAlive(secondPID), "kube-apiserver still running after Stop")
		_, err := os.Stat(dir)
		require.True(t, errors.Is(err, os.ErrNotExist), "cluster directory left behind: %v", err)
	})
}

func TestControllerManagerSignsClientCertificates(t *testing.T) {
	skipIfShort(t)
	t.Parallel()
	c := Start(t, WithControllerManager())
	ctx := t.Context()

	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(t, err)
	csrDER, err := x509.CreateCertificateRequest(rand.Reader, &x509.CertificateRequest{
		Subject: pkix.Name{CommonName: "csr-user", Organization: []string{"csr-group"}},
	}, key)
	require.NoError(t, err)
	seconds := int32(3600)
	csr, err := c.Client.CertificatesV1().CertificateSigningRequests().Create(ctx, &certificatesv1.CertificateSigningRequest{
		ObjectMeta: metav1.ObjectMeta{Name: "csr-user"},
		Spec: certificatesv1.CertificateSigningRequestSpec{
			Request:           pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE REQUEST", Bytes: csrDER}),
			SignerName:        certificatesv1.KubeAPIServerClientSignerName,
			ExpirationSeconds: &seconds,
			Usages:            []certificatesv1.KeyUsage{certificatesv1.UsageDigitalSignature, certificatesv1.UsageClientAuth},
		},
	}, metav1.CreateOptions{})
	require.NoError(t, err)
	csr.Status.Conditions = append(csr.Status.Conditions, certificatesv1.CertificateSigningRequestCondition{
		Type: certificatesv1.CertificateApproved, Status: corev1.ConditionTrue,
		Reason: "TestApproval", Message: "approved by the test",
	})
	_, err = c.Client.CertificatesV1().CertificateSigningRequests().UpdateApproval(ctx, csr.Name, csr, metav1.UpdateOptions{})
	require.NoError(t, err)

	var certPEM []byte
	err = wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, 30*time.Second, true, func(ctx context.Context) (bool, error) {
		got, err := c.Client.CertificatesV1().CertificateSigningRequests().Get(ctx, csr.Name, metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		certPEM = got.Status.Certificate
		return len(certPEM) > 0, nil
	})
	require.NoError(t, err, "CSR not signed; controller manager log:\n%s", readTail(c.ControllerManagerLogPath(), 4096))

	keyDER, err := x509.MarshalPKCS8PrivateKey(key)
	require.NoError(t, err)
	keyPEM := pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: keyDER})
	client, err := kubernetes.NewForConfig(c.ClientCertConfig(certPEM, keyPEM))
	require.NoError(t, err)
	self, err := client.AuthenticationV1().SelfSubjectReviews().Create(ctx, &authenticationv1.SelfSubjectReview{}, metav1.CreateOptions{})
	require.NoError(t, err)
	require.Equal(t, "csr-user", self.Status.UserInfo.Username)
	require.Contains(t, self.Status.UserInfo.Groups, "csr-group")
}

func TestBinaryRejectsUnknownNames(t *testing.T) {
	t.Parallel()
	_, err := Binary(t.Context(), t.TempDir(), "etcd")
	require.ErrorContains(t, err, `unknown kube binary "etcd"`)
}

func TestBinaryDirectoryPrecedence(t *testing.T) {
	t.Run("an explicit directory wins over the environment", func(t *testing.T) {
		t.Setenv(BinDirEnv, "/from/env")
		dir, err := resolveBinDir("/explicit")
		require.NoError(t, err)
		require.Equal(t, "/explicit", dir)
	})
	t.Run("the environment wins over the repository's bin directory", func(t *testing.T) {
		t.Setenv(BinDirEnv, "/from/env")
		dir, err := resolveBinDir("")
		require.NoError(t, err)
		require.Equal(t, "/from/env", dir)
	})
	t.Run("without either, bin/ at the repository root is used", func(t *testing.T) {
		t.Setenv(BinDirEnv, "")
		dir, err := resolveBinDir("")
		require.NoError(t, err)
		wd, err := os.Getwd()
		require.NoError(t, err)
		require.Equal(t, filepath.Join(filepath.Dir(filepath.Dir(wd)), "bin"), dir)
	})
}

func TestBuildLockIsExclusiveAcrossOpens(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), buildLockFile)
	unlock, err := lockFile(t.Context(), path)
	require.NoError(t, err)

	ctx, cancel := context.WithTimeout(t.Context(), 500*time.Millisecond)
	defer cancel()
	_, err = lockFile(ctx, path)
	require.ErrorIs(t, err, context.DeadlineExceeded, "a second holder must wait")

	unlock()
	unlock2, err := lockFile(t.Context(), path)
	require.NoError(t, err, "the lock is free again after unlock")
	unlock2()
}

func TestFailedChecksPicksFailingReadyzLines(t *testing.T) {
	t.Parallel()
	body := "[+]ping ok\n[-]poststarthook/rbac/bootstrap-roles failed: not finished\n[+]etcd ok\n[-]informer-sync failed\nreadyz check failed\n"
	require.Equal(t, "poststarthook/rbac/bootstrap-roles failed: not finished; informer-sync failed", failedChecks([]byte(body)))
}

func TestRunRejectsInvalidOptionsBeforeStartingAnything(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		opt  Option
		want string
	}{
		{"a max token expiration below the API server's 1h minimum", WithMaxTokenExpiration(10 * time.Minute), "below the API server's minimum"},
		{"a zero start timeout", WithStartTimeout(0), "timeouts must be positive"},
		{"a min request timeout below a second", WithMinRequestTimeout(500 * time.Millisecond), "whole number of seconds"},
		{"a min request timeout that is not whole seconds", WithMinRequestTimeout(1500 * time.Millisecond), "whole number of seconds"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			c, err := Run(t.Context(), WithBinDir(t.TempDir()), tc.opt)
			require.ErrorContains(t, err, tc.want)
			require.Nil(t, c)
		})
	}
}

func TestFailedStartReportsTheAPIServerLogAndLeavesNothingBehind(t *testing.T) {
	skipIfShort(t)
	tmp := t.TempDir()
	t.Setenv("TMPDIR", tmp) // where Run creates its directory
	c, err := Run(t.Context(), WithAPIServerArgs("--no-such-flag"))
	require.Nil(t, c)
	require.ErrorContains(t, err, "kube-apiserver not ready: process exited")
	require.ErrorContains(t, err, "unknown flag: --no-such-flag", "the error carries the log tail")
	entries, err := os.ReadDir(tmp)
	require.NoError(t, err)
	require.Empty(t, entries, "cluster directory left behind")
}
